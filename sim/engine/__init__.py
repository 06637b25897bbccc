"""A real inference engine behind the model seam (docs/engine.md): llama.cpp from the `engine`
extra, started and owned (`process`), its slots' KV semantics per design (`slots`), and the
`TokenModel` that drives it with the simulator's planned tokens (`model`)."""
