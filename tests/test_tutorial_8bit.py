"""The tutorial's script runs a few steps, reports perplexity, and 8-bit Adam uses less memory."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.timeout(400)
def test_gpt2_8bit_example(tmp_path):
    out = subprocess.run([sys.executable, "examples/gpt2_8bit/train.py", "--steps", "6", "--log-every", "3",
                          "--batch-size", "4", "--seq-len", "64", "--corpus", str(tmp_path / "corpus.txt")],
                         capture_output=True, text=True, timeout=380)
    assert out.returncode == 0, out.stderr[-2000:]
    ppl = [float(x) for x in re.findall(r"perplexity ([\d.]+)", out.stdout)]
    assert len(ppl) == 2 and ppl[1] < 256  # below the uniform byte model's perplexity
    fp32 = float(re.search(r"fp32 Adam\s+([\d.]+)", out.stdout).group(1))
    eight = float(re.search(r"8-bit Adam\s+([\d.]+)", out.stdout).group(1))
    assert eight < fp32
