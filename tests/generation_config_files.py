"""The generation_config.json the generation-config tests give the tiny model, and the sampling parameters
it stands for (written out by hand, not derived by the code under test)."""

import json
from pathlib import Path
from typing import Any

from tokenmill.sampling_params import SamplingParams

# Greedy, with a repetition penalty that changes the tiny model's greedy tokens; the other keys are
# generation-config fields that are not sampling defaults.
FILE: dict[str, Any] = {
    "temperature": 0.0,
    "top_p": 0.9,
    "top_k": 7,
    "min_p": 0.05,
    "repetition_penalty": 1.5,
}
FILE |= {"max_new_tokens": 8, "do_sample": True, "eos_token_id": 2, "bos_token_id": 1}
FROM_FILE = SamplingParams(
    temperature=0.0, top_p=0.9, top_k=7, min_p=0.05, repetition_penalty=1.5, max_tokens=8
)
PLAIN_GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def write_generation_config(folder: Path, fields: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(fields))
    return folder
