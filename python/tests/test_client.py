"""The installed wheel against a live server (conftest.py): every call of the Python API, checked
against the server's own answers and against the `exactscore` CLI the wheel put on PATH."""

import builtins
import io
import json
import os
import pydoc
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

import exactscore
from exactscore import _support
from conftest import API_KEY

TEXT = "To be, or not to be, that is the question."
# Documents of the tiny model's vocabulary: 2 documents, enough tokens for several windows.
TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 12,
    "It was the best of times, it was the worst of times. " * 10,
]
# About 9,500 tokens: long enough for a context the server refuses, and for a run to interrupt.
LONG = [f"Document {i}: " + " ".join(TEXTS) * 3 for i in range(8)]
# Small windows keep every run to a fraction of a second on the debug server.
RUN = dict(ctx=32, stride=16, concurrency=3, progress=False)


@pytest.fixture
def client(server):
    return exactscore.Client(server.url, api_key=API_KEY)


def bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def cli(*args, cwd=None):
    """Runs the `exactscore` on PATH (the wheel's), failing the test on a non-zero exit."""
    exe = shutil.which("exactscore")
    assert exe is not None, "exactscore is not on PATH"
    out = subprocess.run([exe, *args], capture_output=True, text=True, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return out


def without_timings(report: dict) -> dict:
    return {k: v for k, v in report.items() if k not in ("wall_time_s", "tokens_per_s")}


def test_the_cli_is_the_wheels_and_runs():
    exe = Path(shutil.which("exactscore"))
    assert exe.parent == Path(sys.executable).parent
    out = cli("--help")
    for command in ("ppl", "kld", "compare", "score", "info"):
        assert command in out.stdout


def test_wikitext2_comes_with_the_wheel():
    path = Path(_support.wikitext_path())
    assert path.name == "wikitext-2-raw-test.txt.gz"
    assert Path(sys.prefix).resolve() in path.parents


def test_info_is_the_servers(client, server):
    status, body = server.request("/info")
    assert status == 200
    assert client.info() == body
    assert client.info()["reference"]["model"] == "llama-dense-bf16"


@pytest.mark.parametrize("top_k", [0, 3])
def test_score_text_equals_the_servers_bitwise(client, server, top_k):
    r = client.score(TEXT, top_k=top_k)
    status, body = server.request(
        "/score",
        {
            "text": TEXT,
            "add_special_tokens": True,
            "top_k": top_k,
            "return": {"token_logprobs": True, "top_k": top_k > 0, "greedy": True, "token_strings": True},
        },
    )
    assert status == 200
    seq = body["sequences"][0]
    assert r.model == body["model"] == "llama-w4a16-g128"
    assert r.tokens == seq["tokens"]
    assert isinstance(r.logprobs, np.ndarray) and r.logprobs.dtype == np.float32
    assert np.isnan(r.logprobs[0]) and seq["token_logprobs"][0] is None
    assert (bits(r.logprobs[1:]) == bits(seq["token_logprobs"][1:])).all()
    assert r.sum_nll == seq["sum_nll"]
    assert (r.num_scored, r.mean_nll, r.perplexity) == (seq["num_scored"], seq["mean_nll"], seq["perplexity"])
    assert r.token_strings == seq["token_strings"]
    assert r.greedy == seq["greedy"]
    assert len(r) == len(seq["tokens"])
    if top_k:
        assert [[(i, s) for i, _, s in row] for row in r.top_k] == [[(t["id"], t.get("token")) for t in row] for row in seq["top_k"]]
        assert (bits([t[1] for row in r.top_k for t in row]) == bits([t["logprob"] for row in seq["top_k"] for t in row])).all()
    else:
        assert r.top_k is None


def test_score_tokens_equals_the_servers_bitwise(client, server):
    tokens = [1992, 51, 78, 354, 11, 450, 483]
    r = client.score(tokens)
    status, body = server.request(
        "/score",
        {"tokens": tokens, "top_k": 0, "return": {"token_logprobs": True, "top_k": False, "greedy": True, "token_strings": True}},
    )
    assert status == 200
    seq = body["sequences"][0]
    assert r.tokens == tokens
    assert (bits(r.logprobs[1:]) == bits(seq["token_logprobs"][1:])).all()
    # numpy ints are token ids too.
    assert (bits(client.score(np.array(tokens)).logprobs[1:]) == bits(r.logprobs[1:])).all()


def test_score_without_numpy_is_a_list(client, monkeypatch):
    with_numpy = client.score(TEXT).logprobs
    monkeypatch.setitem(sys.modules, "numpy", None)
    r = client.score(TEXT)
    assert isinstance(r.logprobs, list)
    assert r.logprobs[0] is None
    assert (bits(r.logprobs[1:]) == bits(with_numpy[1:])).all()


def test_kld_equals_the_servers_bitwise(client, server):
    r = client.kld(TEXT)
    status, body = server.request("/kld", {"text": TEXT, "add_special_tokens": True, "per_token": True})
    assert status == 200
    seq = body["sequences"][0]
    assert (r.model, r.reference_model) == (body["model"], body["reference_model"])
    assert r.tokens == seq["tokens"]
    for name, dtype in [("kld", np.float64), ("delta_p", np.float64), ("logprobs", np.float32), ("reference_logprobs", np.float32)]:
        ours = getattr(r, name)
        assert ours.dtype == dtype and np.isnan(ours[0]) and seq[name][0] is None
        assert (ours[1:] == np.asarray(seq[name][1:], dtype=dtype)).all(), name
    assert r.same_top == seq["same_top"]
    for name in ("num_scored", "sum_kld", "sum_nll", "reference_sum_nll", "same_top_count", "sum_delta_p", "sum_delta_p_squared"):
        assert getattr(r, name) == seq[name], name
    assert r.mean_kld == seq["sum_kld"] / seq["num_scored"]


def test_bad_input_raises_server_error_with_the_servers_message(client, server):
    bad = [1992, 51, 99999]
    with pytest.raises(exactscore.ServerError) as e:
        client.score(bad)
    status, body = server.request("/score", {"tokens": bad, "top_k": 0})
    assert e.value.status == status == 422
    assert e.value.body == body
    assert (e.value.message, e.value.field, e.value.rule) == (body["error"], body["field"], body["rule"])
    assert body["error"] in str(e.value)
    assert e.value.url == server.url + "/score"

    with pytest.raises(exactscore.ServerError) as e:
        client.score(TEXT, top_k=21)
    assert e.value.status == 422 and e.value.field == "top_k"

    with pytest.raises(exactscore.ServerError) as e:
        client.kld([1992, -5])
    status, body = server.request("/kld", {"tokens": [1992, -5], "per_token": True})
    assert (e.value.status, e.value.body) == (status, body)


def test_a_wrong_api_key_is_a_server_error(server):
    with pytest.raises(exactscore.ServerError) as e:
        exactscore.Client(server.url, api_key="wrong").info()
    status, body = server.request("/info", api_key="wrong")
    assert (e.value.status, e.value.body) == (status, body) and status == 401


def test_no_server_is_a_connection_error():
    closed = exactscore.Client("http://127.0.0.1:9", retries=0)
    with pytest.raises(exactscore.ConnectionError) as e:
        closed.info()
    assert isinstance(e.value, builtins.ConnectionError)
    assert isinstance(e.value, exactscore.ExactScoreError)
    assert "no server answers there" in str(e.value) and e.value.url == "http://127.0.0.1:9"
    assert "cargo run --release -p exactscore-server" in str(e.value)


def test_refused_arguments_are_validation_errors(client, tmp_path):
    for make in (lambda: exactscore.Client("ftp://x"), lambda: exactscore.Client([]), lambda: exactscore.Client("http://x", timeout=0)):
        with pytest.raises(exactscore.ValidationError):
            make()
    with pytest.raises(exactscore.ValidationError, match='method "bogus": expected one of "exl3", "disjoint", "rolling"'):
        client.ppl(TEXTS, method="bogus", **RUN)
    with pytest.raises(exactscore.ValidationError, match="unknown dataset type"):
        client.ppl("data.csv", **RUN)
    with pytest.raises(exactscore.ValidationError, match="^ctx=17000 exceeds the server's max_input_tokens 16384"):
        client.ppl(LONG, ctx=17000, max_windows=1, progress=False)
    existing = tmp_path / "partial.jsonl"
    existing.write_text("{}\n")
    with pytest.raises(exactscore.ValidationError, match="already exists"):
        client.ppl(TEXTS, output=existing, **RUN)
    assert isinstance(exactscore.ValidationError("x"), ValueError)


def test_ppl_equals_the_clis_report(client, server, tmp_path):
    out = tmp_path / "cli.json"
    cli("ppl", "--server", server.url, "--api-key", API_KEY, "--dataset", "wikitext2",
        "--ctx", "64", "--stride", "32", "--max-windows", "24", "--concurrency", "3",
        "--no-progress", "--json", str(out), cwd=tmp_path)
    ours = client.ppl("wikitext2", ctx=64, stride=32, max_windows=24, concurrency=3, progress=False)
    theirs = json.loads(out.read_text())
    assert without_timings(ours.to_dict()) == without_timings(theirs)
    assert ours.windows == 24 and ours.perplexity == theirs["perplexity"]
    # Fields are attributes; the JSON and the dict agree; the CLI's file reads back.
    assert all(getattr(ours, k) == v for k, v in ours.to_dict().items())
    assert json.loads(ours.to_json()) == ours.to_dict()
    assert exactscore.Report.from_json(out.read_text()).to_dict() == theirs
    assert exactscore.Report.from_json(out).to_dict() == theirs
    assert exactscore.Report.from_json(str(out)).to_dict() == theirs
    assert "perplexity" in str(ours) and repr(ours).startswith("Report(dataset='wikitext2'")
    with pytest.raises(AttributeError):
        ours.no_such_field
    assert {"perplexity", "per_window", "to_pandas"} <= set(dir(ours))


def test_ppl_of_texts_equals_the_clis_on_the_same_jsonl(client, server, tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": t}) + "\n" for t in TEXTS))
    out = tmp_path / "cli.json"
    cli("ppl", "--server", server.url, "--api-key", API_KEY, "--dataset", str(jsonl), "--field", "body",
        "--method", "rolling", "--ctx", "33", "--no-progress", "--json", str(out))
    theirs = json.loads(out.read_text())
    from_texts = client.ppl(TEXTS, method="rolling", ctx=33, progress=False).to_dict()
    from_file = client.ppl(jsonl, field="body", method="rolling", ctx=33, progress=False).to_dict()
    assert without_timings(from_file) == without_timings(theirs)
    assert from_texts["dataset"]["name"] == "2 texts"
    for r in (from_texts, theirs):
        del r["dataset"]["name"]
    assert without_timings(from_texts) == without_timings(theirs)


def test_ppl_over_two_servers_equals_one(client, server):
    one = client.ppl(TEXTS, **RUN)
    # The same server under two names: two servers to the runner (it drops repeated URLs).
    by_name = server.url.replace("127.0.0.1", "localhost")
    two = exactscore.Client([server.url, by_name], api_key=API_KEY).ppl(TEXTS, **RUN)
    assert two.servers == [server.url, by_name + " via " + server.url[len("http://"):]]
    assert two.per_window == one.per_window and two.perplexity == one.perplexity


def test_kld_eval_equals_the_clis_report(client, server, tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out = tmp_path / "cli.json"
    args = ["kld", "--server", server.url, "--api-key", API_KEY, "--dataset", str(jsonl),
            "--ctx", "32", "--stride", "16", "--no-progress"]
    cli(*args, "--per-token", "--json", str(out))
    theirs = json.loads(out.read_text())
    ours = client.kld_eval(jsonl, **RUN)
    assert without_timings(ours.to_dict()) == without_timings(theirs)
    # Without --per-token the CLI's report keeps the statistics and the histogram, not each
    # token's KLD.
    compact = tmp_path / "compact.json"
    cli(*args, "--json", str(compact))
    small = json.loads(compact.read_text())
    assert small["kld"] == theirs["kld"] and small["kld"]["histogram"]
    assert all(w["kld"]["kld"] == [] for w in small["per_window"])
    assert compact.stat().st_size < out.stat().st_size
    assert ours.kld["mean_kld"] > 0 and "mean_kld" in repr(ours)


def test_to_pandas(client):
    report = client.ppl(TEXTS, **RUN)
    row = report.to_pandas()
    assert len(row) == 1
    assert row["perplexity"][0] == report.perplexity
    assert row["dataset.name"][0] == "2 texts" and row["server_info.model"][0] == "llama-w4a16-g128"
    windows = report.to_pandas(per_window=True)
    assert list(windows["window"]) == list(range(report.windows))
    assert windows["sum_nll"].sum() == pytest.approx(report.total_nll, rel=1e-12)


def test_diff_per_layer_and_its_round_trip(client, server, tmp_path):
    report = client.diff(TEXTS, ctx=32, windows=2)
    info = client.info()
    assert isinstance(report, exactscore.DiffReport)
    assert len(report.layers) == info["num_layers"] and report.windows == 2
    assert report.kld["mean_kld"] > 0 and "layer" in str(report)
    layers = report.to_pandas()
    assert list(layers["layer"]) == list(range(info["num_layers"]))
    saved = tmp_path / "diff.json"
    saved.write_text(report.to_json())
    assert exactscore.DiffReport.from_json(saved).to_dict() == report.to_dict()
    report.plot(tmp_path / "layers.png")
    assert (tmp_path / "layers.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(exactscore.ValidationError, match="attribute=True"):
        client.diff(TEXTS, ctx=32, windows=2, attribute_pattern="*.down_proj")
    with pytest.raises(exactscore.ValidationError, match="no attribution"):
        report.to_pandas("attribution")


def test_compare_reports_and_refuse_mismatches(client, tmp_path):
    a = client.kld_eval(TEXTS, **RUN)
    b = client.ppl(TEXTS, **RUN)
    path = tmp_path / "b.json"
    path.write_text(b.to_json())
    table = exactscore.compare([a, path], plot=tmp_path / "cmp.png")
    assert table.splitlines()[0].startswith("model") and len(table.splitlines()) == 3
    assert (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"
    fewer = client.ppl(TEXTS, max_windows=1, **RUN)
    with pytest.raises(exactscore.ValidationError, match="windows 1 vs"):
        exactscore.compare([a, fewer])
    assert "(≠ windows 1 vs" in exactscore.compare([a, fewer], allow_mismatch=True)
    with pytest.raises(exactscore.ValidationError, match=r"\.png and \.svg"):
        exactscore.compare([a], plot=tmp_path / "cmp.pdf")


def test_python_defaults_are_the_clis():
    help_text = cli("ppl", "--help").stdout
    signature = exactscore.Client.ppl.__text_signature__
    for name, flag in [("ctx", "ctx"), ("stride", "stride"), ("concurrency", "concurrency")]:
        default = re.search(rf"--{flag} <\w+>\n.*?\[default: (\d+)\]", help_text, re.S).group(1)
        assert f"{name}={default}" in signature, (name, default, signature)
    assert "http://127.0.0.1:8000" in help_text


def test_interrupted_ppl_resumes_to_the_same_report(client, tmp_path):
    # A runner that starts Python with SIGINT ignored (a non-interactive shell's background job)
    # leaves Python without its KeyboardInterrupt handler: install it for this test.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    args = dict(ctx=32, stride=8, max_windows=80, concurrency=2, progress=False)
    uninterrupted = client.ppl(LONG, **args)
    partial = tmp_path / "run.partial.jsonl"
    stop = threading.Event()

    def ctrl_c_after_three_windows():
        # A header line, then one line per finished window.
        while not stop.is_set():
            if partial.exists() and len(partial.read_text().splitlines()) >= 4:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.001)

    watcher = threading.Thread(target=ctrl_c_after_three_windows, daemon=True)
    watcher.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match=r"interrupted after \d+/80 windows; finished windows are in .*resume=True"):
        client.ppl(LONG, output=partial, **args)
    stop.set()
    watcher.join()
    lines = partial.read_text().splitlines()
    done = len(lines) - 1
    assert 3 <= done < 80, done
    assert all(json.loads(line) for line in lines)  # no torn line
    assert time.monotonic() - started < 60

    resumed = client.ppl(LONG, output=partial, resume=True, **args)
    assert resumed.resumed_windows == done
    assert resumed.per_window == uninterrupted.per_window
    assert resumed.perplexity == uninterrupted.perplexity
    assert len(partial.read_text().splitlines()) == 81
    signal.signal(signal.SIGINT, previous)


def test_the_gil_is_released_while_waiting(client):
    # A Python thread counts while the main thread waits in ppl: it can only count while the
    # main thread does not hold the GIL.
    ticks = [0]
    running = threading.Event()
    running.set()

    def count():
        while running.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    counter = threading.Thread(target=count, daemon=True)
    counter.start()
    time.sleep(0.05)
    before = ticks[0]
    client.ppl(TEXTS, ctx=32, stride=8, concurrency=1, progress=False)
    during = ticks[0] - before
    running.clear()
    counter.join()
    assert during >= 10, during  # about one a millisecond; none with the GIL held


def test_progress_bar_only_where_seen(client, monkeypatch, capsys):
    client.ppl(TEXTS, ctx=32, stride=32)
    assert capsys.readouterr().err == ""  # pytest's stderr is no terminal
    monkeypatch.setattr(_support, "_seen", lambda: True)
    report = client.ppl(TEXTS, ctx=32, stride=32)
    err = capsys.readouterr().err
    n = report.windows
    assert f"{n}/{n}" in err and "windows" in err and "tok/s, ppl" in err


def test_jupyter_counts_as_seen(monkeypatch):
    class ZMQInteractiveShell:  # the kernel's shell class, by name
        pass

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # no terminal
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: None))
    assert not _support._seen()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=ZMQInteractiveShell))
    assert _support._seen()


def test_help_reads_well():
    text = pydoc.render_doc(exactscore.Client, renderer=pydoc.plaintext)
    assert "Client(url='http://127.0.0.1:8000', api_key=None, timeout=600.0, retries=8)" in text
    assert "ppl(self, dataset='wikitext2', *, method='exl3', ctx=2048, stride=512, concurrency=4" in text
    assert "score(self, input, /, *, top_k=0, add_special_tokens=True)" in text
    for method in ("info", "score", "kld", "ppl", "kld_eval"):
        assert getattr(exactscore.Client, method).__doc__, method
    for cls in (exactscore.ScoreResult, exactscore.KldResult, exactscore.Report, exactscore.ServerError):
        assert cls.__doc__ and len(cls.__doc__) > 80, cls
    assert "perplexity_stderr" in exactscore.Report.__doc__
