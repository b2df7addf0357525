"""Each family added for issue 32, served by `dataflow run` on 2 rank processes from a tiny random transformers
checkpoint: its greedy tokens equal transformers' generate (the checkpoint's own implementation, fp32)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from test_hf_parity import VOCAB, _build

NEW_FAMILIES = ["deepseek_v3", "glm4_moe_lite", "dots1", "minimax_m2", "granitemoe", "ernie4_5_moe",
                "hunyuan_v1_moe"]
NEW_TOKENS = 8


def _dataflow(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dataflow", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=240)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_two_rank_run_equals_transformers_greedy_tokens(family, tmp_path):
    ckpt = tmp_path / "ckpt"
    model, _ = _build(family, ckpt)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 19)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": p}) + "\n"
                                              for i, p in enumerate(prompts)))
    res = _dataflow("compile", str(ckpt), "--ranks", "2", "-o", "plan", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    res = _dataflow("run", "plan", "--prompts", "p.jsonl", "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos",
                    "-o", "out.jsonl", "-q", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    got = {json.loads(l)["id"]: json.loads(l)["output_token_ids"] for l in (tmp_path / "out.jsonl").read_text().splitlines()}
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got[f"r{i}"] == out[0, len(prompt):].tolist(), f"{family} request {i}"
