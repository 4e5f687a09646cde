"""The Python code blocks of README.md and docs/*.md run as written, on CPU.

Every fenced block that opens with ```python is code a user may paste. The blocks of one file
run in order in one namespace (a later block may use what an earlier one defined), in a fresh
Python process with JAX on CPU split into 8 host devices (so that the examples over a mesh run
on any machine, the GPU machine included), in a scratch directory. A block that cannot run on
a CPU by design is marked by an HTML comment on the line before its fence,
`<!-- docs:skip why it cannot run -->`, and is left out; the reason is required.

Every `jax.make_mesh` call in those blocks names its `axis_types`: JAX's default changed from
Auto to Explicit (jax 0.9), and an example must mean the same on every JAX the project claims.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys
from typing import NamedTuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DEVICES_FLAG = "--xla_force_host_platform_device_count"
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
SKIP = re.compile(r"^\s*<!--\s*docs:skip\b(.*?)-->\s*$")
BLOCK_TIMEOUT_S = 600  # all the blocks of one file, process start included


class Block(NamedTuple):
  path: pathlib.Path
  line: int  # 1-based line of the block's first code line in the file
  code: str
  skip: str | None  # the reason given in a docs:skip marker, "" for a marker without one


def blocks(path: pathlib.Path) -> list[Block]:
  """The ```python blocks of a Markdown file, with the docs:skip marker before each, if any."""
  lines = path.read_text().splitlines()
  found, i = [], 0
  while i < len(lines):
    m = FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    indent, fence, lang = m.groups()
    end = i + 1
    while end < len(lines) and not lines[end].strip().startswith(fence):
      end += 1
    if lang == "python":
      prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
      skip = SKIP.match(prev)
      body = [ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:end]]
      found.append(Block(path, i + 2, "\n".join(body) + "\n",
                         None if skip is None else skip.group(1).strip()))
    i = end + 1
  return found


def _name(path: pathlib.Path) -> str:
  return str(path.relative_to(ROOT))


# Run in the child process: reads [(filename, line, code)] as JSON on stdin and executes the
# blocks in order in one namespace, each compiled with its own file name and line numbers so
# that a traceback points into the Markdown file.
RUNNER = r"""
import json, sys, time
blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
for filename, line, code in blocks:
  start = time.perf_counter()
  exec(compile("\n" * (line - 1) + code, filename, "exec"), namespace)
  print(f"{filename}:{line}: {time.perf_counter() - start:.1f} s", flush=True)
"""


def child_env() -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  flags = env.get("XLA_FLAGS", "")
  if DEVICES_FLAG not in flags:
    env["XLA_FLAGS"] = f"{flags} {DEVICES_FLAG}=8".strip()
  return env


@pytest.mark.parametrize("path", DOCS, ids=_name)
def test_python_blocks_run(path, tmp_path):
  run = [b for b in blocks(path) if b.skip is None]
  if not run:
    pytest.skip(f"{_name(path)} has no Python block to run")
  payload = json.dumps([(str(b.path), b.line, b.code) for b in run])
  proc = subprocess.run([sys.executable, "-c", RUNNER], input=payload, capture_output=True,
                        text=True, cwd=tmp_path, env=child_env(), timeout=BLOCK_TIMEOUT_S)
  assert proc.returncode == 0, (
      f"a Python block of {_name(path)} failed:\n{proc.stdout}\n{proc.stderr[-8000:]}")


@pytest.mark.parametrize("path", DOCS, ids=_name)
def test_skipped_blocks_say_why(path):
  for b in blocks(path):
    assert b.skip != "", (f"{_name(path)}:{b.line}: a docs:skip marker needs its reason, "
                          "<!-- docs:skip why -->")


def _make_mesh_calls(code: str):
  for node in ast.walk(ast.parse(code)):
    if isinstance(node, ast.Call):
      f = node.func
      name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
      if name == "make_mesh":
        yield node


@pytest.mark.parametrize("path", DOCS, ids=_name)
def test_make_mesh_names_its_axis_types(path):
  for b in blocks(path):
    for call in _make_mesh_calls(b.code):
      assert len(call.args) >= 3 or any(kw.arg == "axis_types" for kw in call.keywords), (
          f"{_name(path)}:{b.line + call.lineno - 1}: jax.make_mesh without axis_types; its "
          "default differs between JAX versions (Auto before 0.9, Explicit since)")


def test_blocks_are_found():
  """The parser sees the README's blocks (a broken fence pattern would pass every test)."""
  assert any(b.code.strip() for b in blocks(ROOT / "README.md"))
