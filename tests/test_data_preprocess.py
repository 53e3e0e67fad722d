"""scripts/preprocess_data.py: JSONL and text into the indexed format; clear errors."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

from parallel3d.data import ByteTokenizer, DataError, IndexedDataset, iter_documents, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["First document.\nWith two lines.", "Zweites Dokument: ünïcode ✓", "third"]


def _script():
    spec = importlib.util.spec_from_file_location("preprocess_data", ROOT / "scripts" / "preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_jsonl_with_byte_tokenizer(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": t, "id": i} for i, t in enumerate(TEXTS)])
    assert _script().main(["--input", str(src), "--json-key", "text", "--tokenizer", "byte",
                           "--output-prefix", str(tmp_path / "out")]) == 0
    stats = json.loads(capsys.readouterr().out)
    ds = IndexedDataset(tmp_path / "out")
    assert stats["documents"] == ds.num_documents == len(TEXTS)
    for d, text in enumerate(TEXTS):
        np.testing.assert_array_equal(ds.get_document(d), list(text.encode("utf-8")) + [ByteTokenizer().eod_id])


def test_text_paragraphs_with_trained_bpe(tmp_path, capsys):
    src = tmp_path / "book.txt"
    src.write_text("\n\n".join(TEXTS * 20) + "\n", encoding="utf-8")
    assert _script().main(["--input", str(src), "--split-paragraphs", "--train-bpe", "300",
                           "--output-prefix", str(tmp_path / "book"), "--no-append-eod"]) == 0
    tok = load_tokenizer(tmp_path / "book.tokenizer.json")
    ds = IndexedDataset(tmp_path / "book")
    assert ds.num_documents == 60
    for d in range(6):
        assert tok.decode(ds.get_document(d).tolist()) == TEXTS[d % 3]


def test_bad_inputs_name_the_problem(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "ok"}, {"body": "no text key"}])
    with pytest.raises(DataError, match=r"in\.jsonl:2: no key 'text' \(found: \['body'\]\)"):
        list(iter_documents([src], "text"))
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{not json\n')
    with pytest.raises(DataError, match=r"broken\.jsonl:2: not valid JSON"):
        list(iter_documents([tmp_path / "broken.jsonl"], "text"))
    _write_jsonl(tmp_path / "num.jsonl", [{"text": 3}])
    with pytest.raises(DataError, match=r"num\.jsonl:1: 'text' holds a int"):
        list(iter_documents([tmp_path / "num.jsonl"], "text"))
    with pytest.raises(DataError, match=r"input file '.*missing\.txt' does not exist"):
        list(iter_documents([tmp_path / "missing.txt"]))
    # The CLI turns them into one line on stderr and exit code 2, with no output files left behind.
    code = _script().main(["--input", str(src), "--json-key", "text", "--tokenizer", "byte",
                           "--output-prefix", str(tmp_path / "out")])
    assert code == 2 and "in.jsonl:2: no key 'text'" in capsys.readouterr().err
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("tokenizer", [["--tokenizer", "byte"], ["--train-bpe", "300"]])
def test_cli_refuses_a_missing_input_or_an_unwritable_prefix_in_one_line(tmp_path, capsys, tokenizer):
    """A missing --input (with the JSONL progress bar, which counts lines first) and an --output-prefix
    whose directory cannot be made are exit code 2 and one line naming the path, before any work."""
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    missing = tmp_path / "missing.jsonl"
    code = _script().main(["--input", str(src), str(missing), "--json-key", "text", *tokenizer,
                           "--output-prefix", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines()[-1] == f"error: input file {str(missing)!r} does not exist"
    (tmp_path / "a_file").write_text("not a directory")
    prefix = tmp_path / "a_file" / "sub" / "out"
    code = _script().main(["--input", str(src), "--json-key", "text", *tokenizer, "--output-prefix", str(prefix)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: output prefix {str(prefix)!r}: cannot write in {prefix.parent}")
    directory = f"{tmp_path}/"  # it wrote the hidden files .bin and .idx there
    code = _script().main(["--input", str(src), "--json-key", "text", *tokenizer, "--output-prefix", directory])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: output prefix {directory!r} names a directory"), err
    code = _script().main(["--input", str(tmp_path), "--json-key", "text", *tokenizer, "--output-prefix",
                           str(tmp_path / "out")])
    assert code == 2 and f"input file {str(tmp_path)!r} is a directory" in capsys.readouterr().err
    assert not list(tmp_path.glob("out*")) and not list(tmp_path.glob(".*"))


@pytest.mark.parametrize("tokenizer", [["--tokenizer", "byte"], ["--train-bpe", "300"]])
def test_text_that_is_not_utf8_is_one_line_naming_where(tmp_path, capsys, tokenizer):
    """Session 43: non-UTF-8 bytes (a latin-1 file) and a JSON lone surrogate ("\\udcff", valid JSON that no
    tokenizer can encode) were a UnicodeDecodeError / UnicodeEncodeError traceback, exit 1; now one line naming
    the file, line and byte or character, exit 2, no output."""
    good = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS).encode()
    cases = {
        "latin1.jsonl": (good + b'{"text": "caf\xe9"}\n', ["--json-key", "text"],
                         r"latin1\.jsonl:4: byte 0xe9 at column 14: not UTF-8 text"),
        "latin1.txt": (b"ok line\nna\xefve\n", [], r"latin1\.txt:2: byte 0xef at column 3: not UTF-8 text"),
        "surrogate.jsonl": (good + b'{"text": "cut \\udcff emoji"}\n', ["--json-key", "text"],
                            r"surrogate\.jsonl:4: 'text' holds the lone surrogate \\udcff at character 4"),
    }
    for name, (raw, key, message) in cases.items():
        (tmp_path / name).write_bytes(raw)
        code = _script().main(["--input", str(tmp_path / name), *key, *tokenizer, "--quiet",
                               "--output-prefix", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and re.search(message, err), (name, err)
        assert not list(tmp_path.glob("out*"))


def test_a_failed_run_does_not_report_its_progress_done(tmp_path, capsys):
    """Review44: without --quiet, the non-UTF-8 error came after "tokenizing into ...: done, 0 doc": the progress
    line said done for a run that failed. It says where it stopped instead, and the error line is last."""
    (tmp_path / "latin1.jsonl").write_bytes(json.dumps({"text": TEXTS[0]}).encode() + b'\n{"text": "caf\xe9"}\n')
    code = _script().main(["--input", str(tmp_path / "latin1.jsonl"), "--json-key", "text", "--tokenizer", "byte",
                           "--output-prefix", str(tmp_path / "out")])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and lines[-1].startswith("error: ") and "not UTF-8 text" in lines[-1], lines
    assert not any(": done," in line for line in lines) and any(": stopped after " in line for line in lines), lines


def test_a_file_that_is_not_a_tokenizer_is_one_line(tmp_path, capsys):
    """Session 43: --tokenizer naming a JSON file (or a directory's tokenizer.json) that is not a tokenizers
    file was tokenizers' bare ``Exception`` traceback; it is one line naming the file, exit 2."""
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    (tmp_path / "junk.json").write_text('{"vocab": 1}')
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "tokenizer.json").write_text("not json")
    for spec in (tmp_path / "junk.json", tmp_path / "dir"):
        code = _script().main(["--input", str(src), "--json-key", "text", "--tokenizer", str(spec), "--quiet",
                               "--output-prefix", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "is not a tokenizers tokenizer.json" in err, err
        with pytest.raises(DataError, match="is not a tokenizers tokenizer.json"):
            load_tokenizer(spec)


@pytest.mark.slow
def test_workers_write_exactly_what_one_worker_writes(tmp_path, capsys):
    """Issue 15: --workers N tokenizes in N processes; the .bin/.idx pair is byte-identical."""
    rng = np.random.default_rng(0)
    words = ["pipeline", "tensor", "ünïcode", "stage", "ZeRO", "✓", "gradient", "the", "of", "\n"]
    records = [{"text": " ".join(rng.choice(words, rng.integers(1, 80)))} for _ in range(700)]  # 3 batches
    src = _write_jsonl(tmp_path / "in.jsonl", records)
    one = tmp_path / "one"
    assert _script().main(["--input", str(src), "--json-key", "text", "--train-bpe", "300",
                           "--output-prefix", str(one)]) == 0
    err = capsys.readouterr().err
    # Off a terminal the progress bar is a start and an end line per phase.
    assert "tokenizing into" in err and "done, 700 doc" in err and "training byte-level BPE" in err
    for workers, tok in ((2, str(one) + ".tokenizer.json"), (3, "byte")):
        ref = tmp_path / f"ref{workers}"
        if tok == "byte":
            assert _script().main(["--input", str(src), "--json-key", "text", "--tokenizer", tok,
                                   "--output-prefix", str(ref), "--quiet"]) == 0
        else:
            ref = one
        out = tmp_path / f"w{workers}"
        assert _script().main(["--input", str(src), "--json-key", "text", "--tokenizer", tok, "--output-prefix",
                               str(out), "--workers", str(workers), "--quiet"]) == 0
        for ext in (".bin", ".idx"):
            assert (Path(str(out) + ext)).read_bytes() == (Path(str(ref) + ext)).read_bytes(), (workers, ext)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["workers"] == 3
