"""Judge Steep's SGLang artefacts with SGLang's own code (run by test_sglang_contract.py).

``python tests/rl_core/sglang_contract.py < artefacts.json`` with SGLang on ``PYTHONPATH``
(``.venv/sglang-check``, deploy/sglang-check.txt) prints one JSON verdict. What it uses:

- ``sglang.srt.server_args.ServerArgs.add_cli_args``: the parser ``sglang.launch_server``
  parses its command line with; it imports ``triton`` at module level without using it to
  parse, so an empty ``triton`` is provided (triton is 1 GB and needs a GPU to do anything);
- ``sglang.api.v1.api_types``: the JSON contract the server gates ``/generate`` bodies with
  (``generate_contract_error``) and the schema of its answers (``GenerateResponse``);
- ``sglang.srt.sampling.sampling_params.SamplingParams``: the server's own sampling params,
  built from each body's ``sampling_params`` and verified;
- ``sglang/srt/managers/io_struct.py`` and ``entrypoints/http_server.py``, read as source
  (``ast``) for the request classes of the control routes: importing ``io_struct`` pulls in
  ``sglang.srt.configs`` and through it ``torchvision``, whose PyPI build does not load
  against the CPU torch ("operator torchvision::nms does not exist").
"""

from __future__ import annotations

import argparse
import ast
import importlib.abc
import importlib.machinery
import json
import sys
from pathlib import Path
from unittest import mock


class _EmptyTriton(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``triton`` and its submodules as modules whose every attribute is a stand-in."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "triton":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__, module.__name__ = [], spec, spec.name
        module.__file__ = f"<{spec.name} stand-in>"
        return module

    def exec_module(self, module):
        pass


def _class_fields(tree: ast.Module) -> dict[str, set[str]]:
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def fields(name: str, seen: frozenset = frozenset()) -> set[str]:
        node = classes.get(name)
        if node is None or name in seen:
            return set()
        found = {
            item.target.id
            for item in node.body
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
        }
        for base in node.bases:
            if isinstance(base, ast.Name):
                found |= fields(base.id, seen | {name})
        return found

    return {name: fields(name) for name in classes}


def _route_classes(tree: ast.Module) -> dict[str, str]:
    """``{"/path": "RequestClass"}`` for the server's routes that take a request object."""
    routes: dict[str, str] = {}
    for node in tree.body:
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        paths = [
            d.args[0].value
            for d in node.decorator_list
            if isinstance(d, ast.Call)
            and d.args
            and isinstance(d.args[0], ast.Constant)
            and isinstance(d.args[0].value, str)
            and d.args[0].value.startswith("/")
        ]
        if not paths or not node.args.args:
            continue
        annotation = node.args.args[0].annotation
        if isinstance(annotation, ast.Subscript):  # Annotated[Cls, Body()]
            inner = annotation.slice
            annotation = inner.elts[0] if isinstance(inner, ast.Tuple) else inner
        if isinstance(annotation, ast.Name):
            for path in paths:
                routes[path] = annotation.id
    return routes


def main() -> None:
    sys.meta_path.insert(0, _EmptyTriton())
    import sglang
    from sglang.api.v1.api_types import GenerateResponse
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    artefacts = json.load(sys.stdin)
    root = Path(sglang.__file__).parent / "srt"
    verdict: dict = {"version": sglang.__version__, "commands": [], "generate": []}

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for argv in artefacts["commands"]:
        namespace, unknown = parser.parse_known_args(argv)
        verdict["commands"].append({"unknown": unknown, "args": vars(namespace)})

    for body in artefacts["generate_bodies"]:
        error = generate_contract_error(body)
        try:
            SamplingParams(**body.get("sampling_params", {})).verify(artefacts["vocab_size"])
            sampling_error = None
        except Exception as exc:  # what the server answers 400 with
            sampling_error = f"{type(exc).__name__}: {exc}"
        verdict["generate"].append({"contract": error, "sampling": sampling_error})

    verdict["answers"] = []
    for answer in artefacts["generate_answers"]:
        try:
            canonical = GenerateResponse.from_json_value(answer).to_json_value()
            verdict["answers"].append({"error": None, "canonical": canonical})
        except Exception as exc:
            verdict["answers"].append({"error": f"{type(exc).__name__}: {exc}"})

    classes = _class_fields(ast.parse((root / "managers" / "io_struct.py").read_text()))
    routes = _route_classes(ast.parse((root / "entrypoints" / "http_server.py").read_text()))
    verdict["routes"] = {
        path: {"class": routes.get(path), "fields": sorted(classes.get(routes.get(path, ""), ()))}
        for path in artefacts["control_paths"]
    }
    json.dump(verdict, sys.stdout, default=str)


if __name__ == "__main__":
    main()
