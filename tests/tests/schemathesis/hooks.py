"""Schemathesis hooks for tests/tests/example_openapi.rs.

Schemathesis draws `Idempotency-Key` values from the document's pattern, so
it sends the same few keys (`!`, `0`, the documented example) with many
different bodies and to both idempotent routes. The server rightly answers
each such reuse 422 (`idempotency_key_reused`), which hides the handler
from most generated requests and which schemathesis's
`positive_data_acceptance` check reads as a valid request refused.

A client sends one key per operation, so each valid key is replaced by one
derived from it, the operation and the body: the same request keeps the
same key (a repeat is a replay, which the checks then see), another request
gets another key. Keys that break the pattern are left as drawn, so the
server's 400s are still tested.
"""

import hashlib
import json
import re

import schemathesis


def key_pattern(operation):
    for parameter in operation.definition.raw.get("parameters", []):
        if parameter.get("in") == "header" and parameter["name"].lower() == "idempotency-key":
            return re.compile(parameter["schema"]["pattern"])
    return None


def one_key_per_request(case):
    headers = case.headers or {}
    key = headers.get("Idempotency-Key")
    pattern = key_pattern(case.operation)
    if isinstance(key, str) and pattern is not None and pattern.fullmatch(key):
        body = "" if case.body is None else json.dumps(case.body, sort_keys=True, default=repr)
        seed = "\0".join([case.operation.label, key, body])
        headers["Idempotency-Key"] = hashlib.sha256(seed.encode()).hexdigest()
    return case


@schemathesis.hook
def map_case(context, case):
    return one_key_per_request(case)


@schemathesis.hook
def before_add_examples(context, examples):
    for case in examples:
        one_key_per_request(case)
