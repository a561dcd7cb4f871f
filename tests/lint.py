"""The developer guide's two style rules that ruff has no rule for, as a linter: `python tests/lint.py FILE...` prints
`path:line: message` for each breach and exits 1 if there is any.

- No class inside a function: it closes over the function's locals, cannot be pickled into TRL's rollout child, and
  hides from a reader who scans the module.
- No control flow reads an exception's message (compares, matches or splits `str(exc)`): errors carry their kind as
  a type, and a decision taken on text breaks silently when a library rewords it. Showing the message is fine. Where a
  process boundary passes only text, its one parser (PARSES_TEXT_OF) may read it.
"""

from __future__ import annotations

import ast
import sys

# TRL's failure channel from the rollout child ("Name: message"), and TRL's VLLMClient, which raises a bare Exception
# holding vLLM's HTTP answer.
PARSES_TEXT_OF = {"stop_from_child", "CudaIpcWeightTransfer.send_weights"}
MESSAGE_READS = {"partition", "rpartition", "startswith", "endswith", "find", "index", "count"}


def functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every module-level function and method, with its qualified name (`Class.method`)."""
    found = []
    for node in tree.body:
        for inner in [node, *(node.body if isinstance(node, ast.ClassDef) else [])]:
            if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((f"{node.name}.{inner.name}" if inner is not node else inner.name, inner))
    return found


def reads_message(node: ast.AST, caught: set[str]) -> bool:
    """Whether `node` compares or parses the text of `str(e)`, e one of the `caught` exception names."""
    parses = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
        getattr(node.func.value, "id", "") == "re" or node.func.attr in MESSAGE_READS)
    if not (isinstance(node, ast.Compare) or parses):
        return False
    return any(isinstance(inner, ast.Call) and getattr(inner.func, "id", "") == "str" and inner.args
               and any(isinstance(n, ast.Name) and n.id in caught for n in ast.walk(inner.args[0]))
               for inner in ast.walk(node))


def lint(path: str) -> list[str]:
    tree = ast.parse(open(path).read(), path)
    problems, parsers = [], set()
    for name, function in functions(tree):
        caught = {n.name for n in ast.walk(function) if isinstance(n, ast.ExceptHandler) and n.name}
        caught |= {a.arg for a in function.args.args if a.arg in ("exc", "error")}
        for node in ast.walk(function):
            if isinstance(node, ast.ClassDef):
                problems.append(f"{path}:{node.lineno}: class {node.name} is defined inside {name}")
            elif reads_message(node, caught) and name in PARSES_TEXT_OF:
                parsers.add(name)
            elif reads_message(node, caught):
                problems.append(f"{path}:{node.lineno}: {name} reads an exception's message; raise a type instead")
    problems += [f"{path}: {name} is listed in PARSES_TEXT_OF but reads no exception's message"
                 for name in sorted(PARSES_TEXT_OF - parsers)]
    return problems


if __name__ == "__main__":
    found = [problem for path in sys.argv[1:] for problem in lint(path)]
    print("\n".join(found))
    sys.exit(1 if found else 0)
