"""Malformed input files fail early and clearly: a prompts file (`--prompts`, PromptSource.from_jsonl) with
`path:line: field: expected ..., found ...`, a checkpoint's config.json (ModelConfig.from_json) with its path and the
field; `compare` exits 2 on either before any work, writing nothing to --out. Example cases for each message, then
generated ones: valid lines mutated one way each (hypothesis), and valid files that must still load."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.cli import DEFAULT_CHECKPOINT, main
from harness.scenarios import PromptSource
from reference.config import _IGNORED_FIELDS, ConfigError, ModelConfig

VOCAB = 97
TINY_CONFIG = json.loads((DEFAULT_CHECKPOINT / "config.json").read_text())
GENERATED = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def _error(path: Path, vocab_size: int = VOCAB) -> str:
    with pytest.raises(ValueError) as err:
        PromptSource.from_jsonl(path, vocab_size)
    return str(err.value)


# ---- the three cases the tester reported ------------------------------------------------------------------------

def test_a_line_without_token_ids_is_named_not_a_bare_key_error(tmp_path):
    path = _write(tmp_path / "p.jsonl", ['{"id": "a", "token_ids": [1, 2]}',
                                         '{"id": "b", "kind": "prose", "text": "hello"}'])
    assert _error(path) == (f"{path}:2: token_ids: expected a list of integer token ids, found no such field "
                            "(the object has id, kind, text)")


@pytest.mark.parametrize("value, found", [("1.5", "1.5 (a float)"), ("2.0", "2.0 (a float)")])
def test_float_token_ids_are_refused_not_truncated(tmp_path, value, found):
    path = _write(tmp_path / "p.jsonl", [f'{{"token_ids": [{value}, 2]}}'])
    assert _error(path) == f"{path}:1: token_ids[0]: expected an integer token id, found {found}"


def test_duplicate_request_ids_name_both_lines(tmp_path):
    path = _write(tmp_path / "p.jsonl", ['{"id": "a", "token_ids": [1]}', '{"id": "b", "token_ids": [2]}', "",
                                         '{"id": "a", "token_ids": [3]}'])
    assert _error(path) == f'{path}:4: id: expected each id once in the file, found "a" again (line 1 has "a")'


# ---- every other malformed line, one message each ---------------------------------------------------------------

@pytest.mark.parametrize("line, message", [
    ('{"token_ids": [1, 2', "expected a JSON object with token_ids, found text that is not JSON (Expecting"),
    ("[1, 2, 3]", "expected a JSON object with token_ids, found [1, 2, 3] (a list)"),
    ("null", "expected a JSON object with token_ids, found null"),
    ('{"token_ids": "1 2 3"}', 'token_ids: expected a list of integer token ids, found "1 2 3" (a string)'),
    ('{"token_ids": null}', "token_ids: expected a list of integer token ids, found null"),
    ('{"token_ids": [1, true]}', "token_ids[1]: expected an integer token id, found true (a boolean)"),
    ('{"token_ids": [1, "5"]}', 'token_ids[1]: expected an integer token id, found "5" (a string)'),
    ('{"token_ids": [NaN]}', "token_ids[0]: expected an integer token id, found NaN (a float)"),
    ('{"token_ids": [3, -1]}', "token_ids[1]: token id -1 outside the model's vocabulary [0, 97)"),
    ('{"token_ids": [97]}', "token_ids[0]: token id 97 outside the model's vocabulary [0, 97) (prompts made for "
                            "another tokenizer?)"),
    ('{"token_ids": []}', "token_ids: expected at least one token id, found an empty list (an empty prompt "
                          "cannot be scored)"),
    ('{"id": 1.5, "token_ids": [1]}', "id: expected a string or an integer, found 1.5 (a float)"),
    ('{"id": true, "token_ids": [1]}', "id: expected a string or an integer, found true (a boolean)"),
    ('{"id": null, "token_ids": [1]}', "id: expected a string or an integer, found null"),
], ids=["not-json", "not-an-object", "null-line", "ids-a-string", "ids-null", "bool-id", "string-id", "nan-id",
        "negative-id", "id-past-vocab", "empty-prompt", "float-request-id", "bool-request-id", "null-request-id"])
def test_each_malformed_line_names_file_line_and_field(tmp_path, line, message):
    path = _write(tmp_path / "p.jsonl", ['{"id": 0, "token_ids": [4, 5]}', line])
    assert _error(path).startswith(f"{path}:2: {message}")


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"token_ids": [1]}\n{"token_ids": [2], "text": "\xff"}\n')
    assert _error(path) == f"{path}:2: expected UTF-8 text, found byte 0xff at column 29"


def test_a_file_without_prompts_is_an_error(tmp_path):
    path = _write(tmp_path / "p.jsonl", ["", "   "])
    assert _error(path) == f"{path}: no prompts (expected one JSON object a line with token_ids)"


def test_valid_lines_with_extra_fields_crlf_and_a_bom_load(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": "x", "kind": "prose", "n_tokens": 2, "token_ids": [1, 2], "text": "a"}\r\n'
                     b'\r\n{"id": 7, "token_ids": [96]}\r\n{"token_ids": [0]}\r\n{"token_ids": [5]}')
    assert PromptSource.from_jsonl(path, VOCAB).prompts == [[1, 2], [96], [0], [5]]


# ---- generated: one mutation of a valid file at a time -------------------------------------------------------

request_ids = st.one_of(st.text(string.ascii_letters + string.digits + "-_", min_size=1, max_size=6),
                        st.integers(-10**6, 10**6))
rows = st.fixed_dictionaries(
    {"token_ids": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)},
    optional={"id": request_ids, "kind": st.sampled_from(["prose", "code"]), "text": st.text(max_size=10)})


@st.composite
def valid_files(draw):
    """Rows with distinct ids (as the reader compares them: by their text), blank lines between some."""
    made, seen = draw(st.lists(rows, min_size=1, max_size=5)), set()
    for row in made:
        if "id" in row and str(row["id"]) in seen:
            del row["id"]
        elif "id" in row:
            seen.add(str(row["id"]))
    blanks = draw(st.lists(st.sampled_from(["", "  ", "\t"]), min_size=len(made), max_size=len(made)))
    gaps = draw(st.lists(st.booleans(), min_size=len(made), max_size=len(made)))
    return made, blanks, gaps


def _lines(made, blanks, gaps, replaced: dict[int, str] | None = None) -> tuple[list[str], list[int]]:
    """The file's lines and each row's (1-based) line number; `replaced`: row index -> that row's text."""
    lines, numbers = [], []
    for i, row in enumerate(made):
        if gaps[i]:
            lines.append(blanks[i])
        lines.append((replaced or {}).get(i, json.dumps(row)))
        numbers.append(len(lines))
    return lines, numbers


def _not_token(value) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


bad_elements = st.one_of(
    st.floats(),                                                   # NaN, Infinity, 1e300 and 0.5 included
    st.integers(-5, 5).map(float), st.booleans(), st.text(max_size=4), st.integers(max_value=-1),
    st.integers(min_value=VOCAB, max_value=10**30), st.none(), st.lists(st.integers(0, 3), max_size=2))


@st.composite
def mutated_files(draw):
    """A valid file with one row broken one way: (lines, the broken row's line, the field the message must name,
    a fragment the message must hold)."""
    made, blanks, gaps = draw(valid_files())
    target = draw(st.integers(0, len(made) - 1))
    row = dict(made[target])
    kinds = ["drop", "element", "not-a-list", "empty", "not-an-object", "broken", "id-type"]
    kind = draw(st.sampled_from(kinds + (["duplicate"] if target > 0 else [])))
    field, fragment = "token_ids", "expected"
    if kind == "drop":
        del row["token_ids"]
        fragment = "found no such field"
    elif kind == "element":
        at = draw(st.integers(0, len(row["token_ids"]) - 1))
        bad = draw(bad_elements)
        row["token_ids"] = [*row["token_ids"][:at], bad, *row["token_ids"][at + 1:]]
        field = f"token_ids[{at}]"
        fragment = "expected an integer token id" if _not_token(bad) else "outside the model's vocabulary"
    elif kind == "not-a-list":
        row["token_ids"] = draw(st.one_of(st.text(max_size=5), st.integers(), st.none(), st.booleans(),
                                          st.dictionaries(st.text(max_size=2), st.integers(), max_size=2)))
        fragment = "expected a list of integer token ids"
    elif kind == "empty":
        row["token_ids"] = []
        fragment = "found an empty list"
    elif kind == "id-type":
        row["id"] = draw(st.one_of(st.floats(), st.booleans(), st.none(), st.lists(st.integers(), max_size=2)))
        field, fragment = "id", "expected a string or an integer"
    elif kind == "duplicate":
        earlier = draw(st.integers(0, target - 1))
        if "id" not in made[earlier]:
            made[earlier] = {**made[earlier], "id": f"dup#{earlier}"}       # '#': no generated id has one
        row["id"] = made[earlier]["id"]
        field, fragment = "id", "expected each id once in the file"
    text = json.dumps(row)
    if kind == "not-an-object":
        text = json.dumps(draw(st.one_of(st.lists(st.integers(0, VOCAB - 1), max_size=3), st.integers(), st.none(),
                                         st.text(max_size=5), st.booleans())))
        field, fragment = None, "expected a JSON object with token_ids, found"
    elif kind == "broken":
        cut = draw(st.integers(1, len(text) - 1))
        text = text[:cut]
        field, fragment = None, "found text that is not JSON"
    lines, numbers = _lines(made, blanks, gaps, {target: text})
    if kind == "duplicate":
        fragment += f", found {json.dumps(row['id'])} again (line {numbers[earlier]} has"
    return lines, numbers[target], field, fragment


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("bad-input")


@GENERATED
@given(case=mutated_files())
def test_generated_malformed_prompt_lines_name_file_line_and_field(workdir, case):
    lines, line_no, field, fragment = case
    path = _write(workdir / "prompts.jsonl", lines)
    message = _error(path)
    prefix = f"{path}:{line_no}: " + (f"{field}: " if field else "")
    assert message.startswith(prefix), (message, prefix)
    assert fragment in message, (message, fragment)
    assert "\n" not in message


@GENERATED
@given(case=valid_files())
def test_generated_valid_prompt_files_load(workdir, case):
    made, blanks, gaps = case
    path = _write(workdir / "prompts.jsonl", _lines(made, blanks, gaps)[0])
    assert PromptSource.from_jsonl(path, VOCAB).prompts == [row["token_ids"] for row in made]


# ---- config.json -----------------------------------------------------------------------------------------------

INT_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
              "mamba_expand", "mamba_chunk_size", "max_position_embeddings", "mamba_d_head"]
BOOL_FIELDS = ["attention_bias", "mlp_bias", "tie_word_embeddings", "mamba_conv_bias", "mamba_proj_bias"]
NUMBER_FIELDS = ["rms_norm_eps", "partial_rotary_factor"]
LIST_FIELDS = ["attn_layer_indices", "time_step_limit"]


def _config_error(directory: Path, text: str) -> str:
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(text)
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_json(directory)
    assert isinstance(err.value, ValueError)
    return str(err.value)


@pytest.mark.parametrize("field, value, message", [
    ("hidden_size", "128", "hidden_size: expected a positive integer, got '128'"),
    ("num_hidden_layers", 2.5, "num_hidden_layers: expected a positive integer, got 2.5"),
    ("mamba_n_groups", True, "mamba_n_groups: expected a positive integer, got True"),
    ("rms_norm_eps", "1e-5", "rms_norm_eps: expected a finite number, got '1e-5'"),
    ("tie_word_embeddings", "false", "tie_word_embeddings: expected true or false, got 'false'"),
    ("attn_layer_indices", [2.0], "attn_layer_indices: expected a list of non-negative integers or null, got [2.0]"),
    ("time_step_limit", 5, "time_step_limit: expected a list of two numbers or null, got 5"),
    ("rope_parameters", {"rope_theta": "1e4"}, "rope_parameters.rope_theta: expected a finite number, got '1e4'"),
    ("mamba_chunck_size", 16, "unknown config fields ['mamba_chunck_size']"),
], ids=["string-int", "float-int", "bool-int", "string-float", "string-bool", "float-index", "scalar-list",
        "rope-string", "unknown"])
def test_config_errors_name_the_file_and_the_field(tmp_path, field, value, message):
    err = _config_error(tmp_path / "ckpt", json.dumps({**TINY_CONFIG, field: value}))
    assert err.startswith(f"{tmp_path / 'ckpt' / 'config.json'}: {message}"), err


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON (Expecting property name enclosed in double quotes"),
    ("", "not valid JSON (Expecting value"),
    ("[1, 2]", "expected a JSON object of config fields, got [1, 2]"),
    ("null", "expected a JSON object of config fields, got null"),
], ids=["broken", "empty", "list", "null"])
def test_config_that_is_not_a_json_object_names_the_file(tmp_path, text, message):
    err = _config_error(tmp_path / "ckpt", text)
    assert err.startswith(f"{tmp_path / 'ckpt' / 'config.json'}: {message}"), err


def _wrong_type(field: str):
    if field in INT_FIELDS:
        return st.one_of(st.floats(), st.integers(1, 64).map(float), st.booleans(), st.integers(1, 64).map(str),
                         st.lists(st.integers(1, 4), max_size=2))
    if field in BOOL_FIELDS:
        return st.one_of(st.integers(0, 1), st.sampled_from(["true", "false", "yes"]), st.floats(0, 1))
    if field in NUMBER_FIELDS:
        return st.one_of(st.sampled_from(["0.5", "1e-5"]), st.booleans(), st.lists(st.floats(0, 1), max_size=2),
                         st.sampled_from([float("nan"), float("inf")]), st.dictionaries(st.text(max_size=2),
                                                                                         st.integers(), max_size=1))
    return st.one_of(st.integers(), st.text(max_size=3).map(lambda s: s or "x"), st.booleans(),
                     st.dictionaries(st.text(max_size=2), st.integers(), min_size=1, max_size=1))


@st.composite
def malformed_configs(draw):
    """(config.json text, what its message must name: a field, or None for text that is not JSON)."""
    kind = draw(st.sampled_from(["wrong-type", "unknown-key", "broken"]))
    if kind == "wrong-type":
        field = draw(st.sampled_from(INT_FIELDS + BOOL_FIELDS + NUMBER_FIELDS + LIST_FIELDS))
        return json.dumps({**TINY_CONFIG, field: draw(_wrong_type(field))}), field
    if kind == "unknown-key":
        known = set(ModelConfig.__dataclass_fields__) | _IGNORED_FIELDS | set(TINY_CONFIG) | {
            "hidden_act", "rope_parameters", "layer_types", "layers_block_type", "time_step_limit"}
        key = draw(st.from_regex(r"[a-z][a-z_]{0,15}", fullmatch=True).filter(lambda k: k not in known))
        return json.dumps({**TINY_CONFIG, key: draw(st.integers() | st.text(max_size=3))}), key
    text = json.dumps(TINY_CONFIG, indent=draw(st.sampled_from([None, 1, 2])))
    return text[:draw(st.integers(0, len(text) - 1))], None


@GENERATED
@given(case=malformed_configs())
def test_generated_malformed_configs_name_the_file_and_the_field(workdir, case):
    text, field = case
    message = _config_error(workdir / "ckpt", text)
    assert message.startswith(f"{workdir / 'ckpt' / 'config.json'}: "), message
    assert (field in message) if field else ("not valid JSON" in message), (message, field)
    assert "cannot be interpreted" not in message, message          # every shape above has its own check


@GENERATED
@given(indent=st.sampled_from([None, 1, 4]), sort=st.booleans(),
       ignored=st.dictionaries(st.sampled_from(sorted(_IGNORED_FIELDS - {"model_type"})), st.integers(0, 3),
                               max_size=3))
def test_generated_valid_configs_still_load(workdir, indent, sort, ignored):
    (workdir / "ok").mkdir(exist_ok=True)
    (workdir / "ok" / "config.json").write_text(json.dumps({**TINY_CONFIG, **ignored}, indent=indent,
                                                           sort_keys=sort))
    assert ModelConfig.from_json(workdir / "ok") == ModelConfig.from_json(DEFAULT_CHECKPOINT)


# ---- the command line: exit 2 before any work, nothing written ---------------------------------------------------

def _usage_error(args, capsys) -> str:
    assert main(["compare", "--engine", "reference", "--scenarios", "batching-alone", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("bamba-harness: error: "), err
    return err


@pytest.mark.parametrize("line, where", [
    ('{"id": "b", "text": "no ids"}', "token_ids: expected a list of integer token ids, found no such field (the "
                                      "object has id, text)"),
    ('{"token_ids": [1.5, 2]}', "token_ids[0]: expected an integer token id, found 1.5 (a float)"),
    ('{"id": "a", "token_ids": [3]}', 'id: expected each id once in the file, found "a" again (line 1 has "a")'),
], ids=["no-token-ids", "float-id", "duplicate-id"])
def test_cli_exits_2_on_a_malformed_prompts_file_before_writing_anything(tmp_path, capsys, monkeypatch, line, where):
    from harness import runner

    monkeypatch.setattr(runner, "check_scenario", lambda *a, **kw: pytest.fail("a scenario ran"))
    prompts = _write(tmp_path / "p.jsonl", ['{"id": "a", "token_ids": [1, 2]}', "", line])
    stale, fresh = tmp_path / "stale", tmp_path / "fresh"
    stale.mkdir()
    (stale / "report.json").write_text('{"stale": true}')
    for out in (stale, fresh):
        err = _usage_error(["--checkpoint", str(DEFAULT_CHECKPOINT), "--prompts", str(prompts), "--out", str(out)],
                           capsys)
        assert err == f"bamba-harness: error: --prompts {prompts}:3: {where}"
    assert (stale / "report.json").read_text() == '{"stale": true}'         # a previous run's files are untouched
    assert sorted(p.name for p in stale.iterdir()) == ["report.json"]
    assert not fresh.exists()                                                # --out is not even created


def test_a_seed_that_would_change_nothing_is_refused(tmp_path, capsys):
    """The bundled model's prompts come from fixtures/prompts.jsonl: --seed would not change them, so it is an error
    (not a silently repeated workload); with --prompts random the seed draws the ids."""
    err = _usage_error(["--checkpoint", str(DEFAULT_CHECKPOINT), "--seed", "3", "--out", str(tmp_path / "a")], capsys)
    assert err.startswith("bamba-harness: error: --seed 3: seeds random prompts only, and these come from ")
    assert err.endswith("prompts.jsonl (add --prompts random for seeded random ones)")
    reports = []
    for seed in ("3", "3", "4"):
        out = tmp_path / f"random-{len(reports)}"
        assert main(["compare", "--engine", "reference", "--scenarios", "batching-alone", "--checkpoint",
                     str(DEFAULT_CHECKPOINT), "--prompts", "random", "--seed", seed, "--out", str(out)]) == 0
        document = json.loads((out / "report.json").read_text())
        assert document["prompts"] == "random"
        reports.append(document["scenarios"][0]["baseline_digest"])
    assert reports[0] == reports[1] != reports[2]                   # the seed draws the workload


def test_cli_names_an_unreadable_prompts_file(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    err = _usage_error(["--checkpoint", str(DEFAULT_CHECKPOINT), "--prompts", str(missing), "--out",
                        str(tmp_path / "out")], capsys)
    assert err == f"bamba-harness: error: --prompts {missing}: not a readable file (No such file or directory)"


def test_cli_exits_2_on_a_config_field_of_the_wrong_type_naming_file_and_field(tmp_path, capsys):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({**TINY_CONFIG, "hidden_size": "128"}))
    err = _usage_error(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "out")], capsys)
    assert err == (f"bamba-harness: error: {checkpoint / 'config.json'}: hidden_size: expected a positive integer, "
                   "got '128'")
    assert not (tmp_path / "out").exists()
