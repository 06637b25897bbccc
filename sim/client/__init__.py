"""The measuring client: the simulated agent's closed loop (`loop`), the clients that speak each
API mode over HTTP, SSE and WebSocket (`client`, `agents_client`), their shared event folding
(`tracker`) and socket lanes (`lanes`), and the tools the agent runs (`tools`)."""
