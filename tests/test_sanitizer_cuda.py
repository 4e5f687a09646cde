"""compute-sanitizer memcheck over the CUDA forward and backward on small cases: no out-of-bounds
or misaligned access, in the kernels or in what XLA runs around them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def test_memcheck_clean():
  sanitizer = shutil.which("compute-sanitizer")
  if sanitizer is None:
    pytest.skip("compute-sanitizer is not on PATH")
  here = os.path.dirname(os.path.abspath(__file__))  # for `import cases`
  # Without preallocation the sanitizer does not shadow most of the GPU's memory.
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  done = subprocess.run(
      [sanitizer, "--tool", "memcheck", "--error-exitcode", "1", sys.executable, "-c",
       "import cases; cases.sanitizer_cases()"],
      env=env, cwd=here, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
  assert "ERROR SUMMARY: 0 errors" in done.stdout + done.stderr
