"""tools/checkpoint/sample_hf.py: the exported folder continues a prompt as our checkpoint does."""

from __future__ import annotations

import pytest

from tests.one_line_errors import assert_one_line_error
from tests.tools.test_generate_samples import GREEDY, continuations
from tests.tools.test_generate_samples import checkpoint as checkpoint  # noqa: F401 (fixture)
from tools.checkpoint import convert_to_hf, sample_hf
from tools.generate_samples_gpt import main as generate_main


@pytest.fixture(scope="module")
def hf_folder(checkpoint, tmp_path_factory) -> str:  # noqa: F811
    """The random TP=2 checkpoint exported to a Hugging Face folder."""
    folder = str(tmp_path_factory.mktemp("sample_hf") / "hf")
    assert convert_to_hf.main(["--load", checkpoint, "--save", folder]) == 0
    return folder


def test_greedy_continuation_equals_ours(checkpoint, hf_folder, capsys):  # noqa: F811
    assert generate_main(["--load", checkpoint, *GREEDY]) == 0
    [ours] = continuations(capsys.readouterr().out)
    assert (
        sample_hf.main(["--load", hf_folder, "--prompt", "def main(", "--max-new-tokens", "8"]) == 0
    )
    theirs = capsys.readouterr().out.rstrip("\n")
    assert theirs.startswith("def main(")
    assert theirs[len("def main(") :] == ours
    assert len(ours) > 0


def test_top_k_sampling_is_seeded(hf_folder, capsys):
    flags = ["--load", hf_folder, "--prompt", "import", "--top-k", "40", "--max-new-tokens", "6"]
    outputs = []
    for seed in ("1", "1", "2"):
        assert sample_hf.main([*flags, "--seed", seed]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    assert all(output.startswith("import") for output in outputs)


def test_a_folder_without_config_is_a_one_line_error(tmp_path, capsys):
    assert sample_hf.main(["--load", str(tmp_path), "--prompt", "x"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: --load") and error.count("\n") == 1


# case -> (flags after --load FOLDER --prompt x, the fragments the error line must name)
BAD_RUNS = {
    "top_p_above_1": (["--top-p", "5"], ["--top-p"]),
    "no_new_tokens": (["--max-new-tokens", "0"], ["--max-new-tokens"]),
    "not_an_int": (["--top-k", "many"], ["--top-k", "'many'"]),
    "config_not_json": (["--load", "{d}/notjson"], ["{d}/notjson/config.json"]),
    "no_weights": (["--load", "{d}/noweights"], ["{d}/noweights"]),
}


@pytest.mark.parametrize("case", sorted(BAD_RUNS))
def test_user_errors_are_one_line(tmp_path, capsys, case):
    """Exit 1, no traceback, one last `error:` line naming the flag or folder."""
    transformers = pytest.importorskip("transformers")
    configs = {"notjson": "{not json", "noweights": transformers.GPT2Config().to_json_string()}
    for name, text in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
    flags, named = BAD_RUNS[case]
    argv = ["--load", str(tmp_path / "noweights"), "--prompt", "x"]
    code = sample_hf.main(argv + [f.format(d=tmp_path) for f in flags])  # a later --load wins
    assert_one_line_error(code, capsys.readouterr().err, *[n.format(d=tmp_path) for n in named])
