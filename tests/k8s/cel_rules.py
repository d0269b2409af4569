"""The CEL rules of a CRD (``x-kubernetes-validations``), evaluated on a document as the API server would on
create: each rule with ``self`` bound to the value at its place (``jsonschema`` ignores them). Transition
rules (those that read ``oldSelf``) only run on an update, so they are skipped here.

Evaluated with cel-python (``celpy``), a test dependency."""

from __future__ import annotations

from typing import Any

import celpy

_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def _program(rule: str):
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _ENV.program(_ENV.compile(rule))
    return _PROGRAMS[rule]


def cel_errors(schema: dict, doc: Any, path: str = "") -> list[str]:
    """``path: message (rule)`` of every CEL rule of ``schema`` that ``doc`` breaks, recursively."""
    errors: list[str] = []
    for validation in schema.get("x-kubernetes-validations") or []:
        rule = validation["rule"]
        if "oldSelf" in rule:
            continue
        try:
            ok = bool(_program(rule).evaluate({"self": celpy.json_to_cel(doc)}))
        except celpy.CELEvalError as err:  # what the API server reports as an invalid value too
            ok, validation = False, {**validation, "message": f"{validation.get('message', '')} ({err})"}
        if not ok:
            errors.append(f"{path or '.'}: {validation.get('message', 'rule failed')} ({rule})")
    if isinstance(doc, dict):
        for name, value in doc.items():
            sub = (schema.get("properties") or {}).get(name)
            if sub is None and isinstance(schema.get("additionalProperties"), dict):
                sub = schema["additionalProperties"]
            if sub is not None:
                errors += cel_errors(sub, value, f"{path}.{name}")
    elif isinstance(doc, list) and isinstance(schema.get("items"), dict):
        for i, value in enumerate(doc):
            errors += cel_errors(schema["items"], value, f"{path}[{i}]")
    return errors
