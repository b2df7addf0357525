"""The compiler's output, pinned: every shipped spec compiled at several rank counts must give the plan.json it gave
when tests/golden/plan_sections.json was written, section by section (a sha256 of each top-level section's JSON).

This is the safety net for changing how lowering works (issue 33: lowering as passes over the dataflow graph): a
refactor must leave every plan as it was. A change that is meant to alter plans (a new field, a better placement)
regenerates the file and says why in its commit:

    python tests/test_plan_golden.py --update
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # (also run as a script, to regenerate the pins)
from graph_ir.spec import load_spec  # noqa: E402
from lowering.plan import compile_plan  # noqa: E402

SPECS = ROOT / "models" / "specs"
GOLDEN = Path(__file__).with_name("golden") / "plan_sections.json"
RANKS = (1, 2, 4, 16, 64)
BIG_MEMORY_GIB = 4096.0  # every published model fits one rank, so each rank count compiles


def plan_sections(name: str, ranks: int) -> dict[str, str]:
    """{section: sha256 of its canonical JSON} of the cuda plan of models/specs/NAME.yaml on `ranks` ranks."""
    mem = None if name.startswith("tiny") else BIG_MEMORY_GIB
    plan = json.loads(compile_plan(load_spec(SPECS / f"{name}.yaml"), ranks, device="cuda",
                                   device_memory_gib=mem).model_dump_json())
    return {k: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:16] for k, v in plan.items()}


def cases() -> list[tuple[str, int]]:
    return [(p.stem, r) for p in sorted(SPECS.glob("*.yaml")) for r in RANKS]


def _golden() -> dict:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


@pytest.mark.parametrize("name,ranks", cases(), ids=[f"{n}-{r}" for n, r in cases()])
def test_every_shipped_plan_compiles_as_pinned(name, ranks):
    key = f"{name}@{ranks}"
    want = _golden().get(key)
    assert want is not None, f"{key} has no pinned plan: run `python tests/test_plan_golden.py --update` and commit"
    got = plan_sections(name, ranks)
    changed = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    assert not changed, (f"{key}: plan sections {changed} differ from tests/golden/plan_sections.json; if the change is "
                         f"meant, regenerate it (`python tests/test_plan_golden.py --update`) and say why")


def test_the_pins_cover_exactly_the_shipped_specs():
    assert sorted(_golden()) == sorted(f"{n}@{r}" for n, r in cases())


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit(__doc__)
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({f"{n}@{r}": plan_sections(n, r) for n, r in cases()}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN} ({len(cases())} plans)")
