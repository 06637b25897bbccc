"""Rebuild `openapi-responses.json` (and `openapi-beta.json`, the responses_multi_agent beta's
inject events, docs/beta.md, and prototype/data/openapi-request.json, the create's request
body, whose constraints the server walks (prototype/wire/constraints.py) and
tests/prototype/wire/test_spec_constraints.py checks) from a full copy of the openai/openai-openapi spec.

    python tests/data/extract_openapi.py path/to/openapi.json

Keeps `components.schemas` entries reachable (through `$ref`) from the schemas the
Responses API's replies use, byte-for-byte values otherwise, so that the pinned file
is small and its provenance (`openapi-responses.source.json`) says where it came from.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

ROOTS = (
    "Response",
    "ResponseStreamEvent",
    "ResponsesServerEvent",
    "ResponseWsError",
    "ErrorResponse",
    "Error",
    "CompactResource",
)
# Kept apart so that the GA extract, which every checked payload is validated against, stays small.
BETA_ROOTS = ("BetaResponseInjectCreatedEvent", "BetaResponseInjectFailedEvent")
REQUEST_ROOTS = ("CreateResponse",)
PREFIX = "#/components/schemas/"
HERE = Path(__file__).parent


def refs(node: Any) -> set[str]:
    """Every component name a `$ref` under `node` points to."""
    found: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str) and ref.startswith(PREFIX):
                found.add(ref[len(PREFIX) :])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def extract(spec: dict[str, Any], roots: tuple[str, ...] = ROOTS) -> dict[str, Any]:
    schemas = spec["components"]["schemas"]
    keep: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            todo.extend(refs(schemas[name]) - keep)
    return {
        "openapi": spec["openapi"],
        "info": {"title": spec["info"]["title"], "version": spec["info"]["version"]},
        "components": {"schemas": {name: schemas[name] for name in sorted(keep)}},
    }


def main(source: str) -> None:
    raw = Path(source).read_bytes()
    out = json.dumps(extract(json.loads(raw)), indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    (HERE / "openapi-responses.json").write_text(out, encoding="utf-8")
    provenance = json.loads((HERE / "openapi-responses.source.json").read_text())
    provenance["source_sha256"] = hashlib.sha256(raw).hexdigest()
    provenance["extract_sha256"] = hashlib.sha256(out.encode()).hexdigest()
    provenance["roots"] = list(ROOTS)
    beta = json.dumps(extract(json.loads(raw), BETA_ROOTS), indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    (HERE / "openapi-beta.json").write_text(beta, encoding="utf-8")
    provenance["beta_extract_sha256"] = hashlib.sha256(beta.encode()).hexdigest()
    provenance["beta_roots"] = list(BETA_ROOTS)
    request = json.dumps(extract(json.loads(raw), REQUEST_ROOTS), indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    (HERE.parents[1] / "prototype" / "data" / "openapi-request.json").write_text(request, encoding="utf-8")
    provenance["request_extract_sha256"] = hashlib.sha256(request.encode()).hexdigest()
    provenance["request_roots"] = list(REQUEST_ROOTS)
    (HERE / "openapi-responses.source.json").write_text(json.dumps(provenance, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
