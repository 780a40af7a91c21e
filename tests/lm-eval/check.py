#!/usr/bin/env python3
"""Re-derive every number an lm-eval `local-completions` run reported, straight from ExactScore's /score.

    python check.py --output-path OUT --url http://127.0.0.1:PORT [--rtol 1e-4] [--tokenizer-json F]
                    [--openai-check] [--model NAME]

OUT is the --output_path of ONE lm_eval run with --log_samples (results_*.json and samples_*.jsonl
are found recursively; the newest results file is used). tokenized_requests and max_length are read
from the run's results["config"]["model_args"] (override with --tokenized-requests / --max-length).

How lm-eval 0.4.13 tokenized (reproduced here, see NOTES.md):
  * every string is encoded with add_special_tokens=False (remote backend: POST /tokenize
    {"prompt": s, "add_special_tokens": false}; huggingface backend: tokenizer(s,
    add_special_tokens=False) unless add_bos_token=True). We use the server's /tokenize the same way;
    --tokenizer-json additionally compares every encoding with a local `tokenizers` copy.
  * loglikelihood(ctx, cont), ctx != "": trailing whitespace of ctx moves to the front of cont;
    whole = enc(ctx + cont); ctx_enc = enc(ctx); cont_enc = whole[len(ctx_enc):].
    ctx == "": ctx_enc = [prefix_token_id] (BOS, i.e. enc(tokenizer_info.bos_token)[0]).
  * inp = (ctx_enc + cont_enc)[-(max_length-1):]; ctxlen = len(ctx_enc) - overflow.
  * loglikelihood_rolling(s): toks = enc(s); windows from get_rolling_token_windows(toks,
    prefix_token=BOS, max_seq_len=max_length-2, context_len=1) + make_disjoint_window;
    inp = ctx + pred, ctxlen = len(ctx); doc value = sum over windows.
  * tokenized_requests=false: lm-eval sends detokenize(inp) as a string; a correct server
    re-tokenizes it WITHOUT adding BOS, so the expected ids are enc(detok(inp)) (usually == inp;
    differences are counted and reported, they are an lm-eval limitation, not a server bug).
  * expected loglikelihood = sum(/score token_logprobs[ctxlen:]) for those ids; lm-eval's value is
    sum(completions token_logprobs[ctxlen:-1]) (the -1 drops the appended greedy token).
  * is_greedy is re-derived from /v1/completions(echo, logprobs=1, max_tokens=0) on the same ids:
    token_logprob == max(top_logprobs.values()) at every continuation position.
Checks: every loglikelihood (rtol), every is_greedy, per-doc acc/acc_norm (argmax of OUR values) and
the aggregated acc/acc_norm, per-doc rolling loglikelihood, scored-token count == token count, and
per-doc acc (= is_greedy) and perplexity of
loglikelihood tasks, the aggregated word_perplexity / byte_perplexity / bits_per_byte. Exit 1 on any mismatch.
"""
import argparse
import glob
import json
import math
import os
import re
import sys
import urllib.request

FAILS = []
WARNS = []


def fail(msg):
    FAILS.append(msg)
    if len(FAILS) <= 30:
        print("MISMATCH:", msg)


def close(a, b, rtol, atol=1e-6):
    return abs(a - b) <= max(atol, rtol * max(abs(a), abs(b)))


class Server:
    def __init__(self, url, model, tok_json=None):
        self.url = url.rstrip("/")
        self.model = model
        self.cache = {}
        self.score_cache = {}
        self.local = None
        if tok_json:
            from tokenizers import Tokenizer
            self.local = Tokenizer.from_file(tok_json)

    def post(self, path, body):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=60) as r:
            return json.loads(r.read())

    def enc(self, s):
        if s not in self.cache:
            ids = self.post("/tokenize", {"prompt": s, "add_special_tokens": False})["tokens"]
            if self.local is not None:
                loc = self.local.encode(s, add_special_tokens=False).ids
                if loc != ids:
                    fail(f"/tokenize differs from local tokenizer.json for {s[:60]!r}")
            self.cache[s] = ids
        return self.cache[s]

    def detok(self, ids):
        return self.post("/detokenize", {"tokens": ids})["prompt"]

    def score(self, seqs):
        """token_logprobs for each id list (batched; memoized)."""
        todo = [s for s in {tuple(x) for x in seqs} if s not in self.score_cache]
        for i in range(0, len(todo), 16):
            chunk = todo[i:i + 16]
            out = self.post("/score", {"tokens": [list(s) for s in chunk]})["sequences"]
            assert len(out) == len(chunk), "/score returned a different number of sequences"
            for s, o in zip(chunk, out):
                lp = o["token_logprobs"]
                if len(lp) != len(s) or lp[0] is not None:
                    fail(f"/score token_logprobs shape: len {len(lp)} for {len(s)} tokens, first={lp[0]}")
                if o.get("tokens") is not None and list(o["tokens"]) != list(s):
                    fail("/score echoed tokens differ from the request")
                if "sum_nll" in o and not close(o["sum_nll"], -sum(lp[1:]), 1e-5):
                    fail(f"/score sum_nll {o['sum_nll']} != -sum(token_logprobs) {-sum(lp[1:])}")
                self.score_cache[s] = lp
        return [self.score_cache[tuple(s)] for s in seqs]

    def completions(self, prompt, max_tokens=0, logprobs=1):
        return self.post("/v1/completions", {"model": self.model, "prompt": prompt, "echo": True,
                                             "logprobs": logprobs, "max_tokens": max_tokens,
                                             "temperature": 0, "seed": 1234})


def rolling_windows(toks, prefix, max_seq_len, context_len=1):
    """Independent re-implementation of lm_eval.utils.get_rolling_token_windows + make_disjoint_window."""
    out = []
    if not toks:
        return out
    pred_len = max_seq_len - context_len + 1
    first = min(max_seq_len, len(toks))
    out.append(([prefix] + toks[:first - 1], toks[:first]))
    done = first
    while done < len(toks):
        n = min(len(toks) - done, pred_len)
        end = done + n
        out.append((toks[end - max_seq_len - 1:end - 1], toks[end - n:end]))
        done += n
    return [(a[:len(a) - (len(b) - 1)], b) for a, b in out]


def load_run(path):
    res = sorted(glob.glob(os.path.join(path, "**", "results_*.json"), recursive=True))
    if not res:
        sys.exit(f"no results_*.json under {path}")
    results = json.load(open(res[-1]))
    stamp = os.path.basename(res[-1])[len("results_"):-len(".json")]
    samples = {}
    for f in glob.glob(os.path.join(os.path.dirname(res[-1]), f"samples_*_{stamp}.jsonl")):
        task = os.path.basename(f)[len("samples_"):-len(f"_{stamp}.jsonl")]
        samples[task] = [json.loads(l) for l in open(f, encoding="utf-8")]
    return results, samples


def as_bool(v):
    return v if isinstance(v, bool) else str(v).lower() in ("true", "1")


def expected_ids(srv, inp, tokenized):
    if tokenized:
        return inp
    ids = srv.enc(srv.detok(inp))
    if ids != inp:
        WARNS.append(f"detok/retok round trip changes ids ({len(inp)} -> {len(ids)} tokens)")
    return ids


def greedy_of(srv, ids, ctxlen):
    c = srv.completions([ids], max_tokens=0, logprobs=1)["choices"][0]["logprobs"]
    return all(t == max(top.values()) for t, top in
               zip(c["token_logprobs"][ctxlen:], c["top_logprobs"][ctxlen:]))


def expected_pair(srv, ctx, cont, L, tokenized, prefix):
    """(ids, ctxlen) exactly as lm-eval's TemplateLM.loglikelihood + batch_loglikelihood_requests."""
    if ctx == "":
        cont_enc = srv.enc(cont)
        ctx_enc, cont_enc = (([prefix], cont_enc) if prefix != cont_enc[0]
                             else (cont_enc[:1], cont_enc[1:]))
    else:
        n = len(ctx) - len(ctx.rstrip())
        if n:
            ctx, cont = ctx[:-n], ctx[-n:] + cont
        whole = srv.enc(ctx + cont)
        ctx_enc = srv.enc(ctx)
        cont_enc = whole[len(ctx_enc):]
    full = ctx_enc + cont_enc
    ctxlen = len(ctx_enc) - max(0, len(full) - L)
    return expected_ids(srv, full[-L:], tokenized), ctxlen


def check_loglik(srv, samples, agg, L, tokenized, prefix, rtol):
    lls, greedies = [], []
    for s in samples:
        ctx, cont = s["arguments"]["gen_args_0"]["arg_0"], s["arguments"]["gen_args_0"]["arg_1"]
        g_ll, g_greedy = float(s["resps"][0][0][0]), as_bool(s["resps"][0][0][1])
        ids, ctxlen = expected_pair(srv, ctx, cont, L, tokenized, prefix)
        ll = sum(srv.score([ids])[0][ctxlen:])
        greedy = greedy_of(srv, ids, ctxlen)
        lls.append(ll)
        greedies.append(greedy)
        if not close(ll, g_ll, rtol):
            fail(f"loglikelihood doc {s['doc_id']} {cont!r}: lm-eval {g_ll!r} vs /score {ll!r}")
        if greedy != g_greedy:
            fail(f"loglikelihood doc {s['doc_id']} {cont!r}: is_greedy lm-eval {g_greedy} vs server {greedy}")
        if "acc" in s and float(s["acc"]) != float(greedy):
            fail(f"loglikelihood doc {s['doc_id']}: acc {s['acc']} vs is_greedy {greedy}")
    mine = {"acc,none": sum(greedies) / len(greedies),
            "perplexity,none": math.exp(-sum(lls) / len(lls))}
    for k, v in mine.items():
        if k in agg and not close(float(agg[k]), v, rtol):
            fail(f"loglikelihood aggregate {k}: lm-eval {agg[k]} vs recomputed {v}")
    print(f"  loglikelihood: {len(samples)} docs, greedy hits {sum(greedies)}, "
          f"acc={mine['acc,none']:.4f} perplexity={mine['perplexity,none']:.6g}")


def check_mc(srv, samples, agg, L, tokenized, prefix, rtol):
    accs, accns = [], []
    for s in samples:
        args = [(v["arg_0"], v["arg_1"]) for _, v in sorted(s["arguments"].items(),
                                                             key=lambda kv: int(kv[0].split("_")[-1]))]
        got = [(float(r[0][0]), as_bool(r[0][1])) for r in s["resps"]]
        lls = []
        for (ctx, cont), (g_ll, g_greedy) in zip(args, got):
            ids, ctxlen = expected_pair(srv, ctx, cont, L, tokenized, prefix)
            lp = srv.score([ids])[0]
            ll = sum(lp[ctxlen:])
            greedy = greedy_of(srv, ids, ctxlen)
            lls.append(ll)
            if not close(ll, g_ll, rtol):
                fail(f"mc doc {s['doc_id']} cont {cont[:30]!r}: lm-eval {g_ll!r} vs /score {ll!r}")
            if greedy != g_greedy:
                fail(f"mc doc {s['doc_id']} cont {cont[:30]!r}: is_greedy lm-eval {g_greedy} vs server {greedy}")
        gold = int(s["target"])
        choices = s["doc"]["choices"]
        pred = max(range(len(lls)), key=lambda i: lls[i])
        pred_n = max(range(len(lls)), key=lambda i: lls[i] / len(choices[i]))
        acc, accn = float(pred == gold), float(pred_n == gold)
        accs.append(acc)
        accns.append(accn)
        if "acc" in s and float(s["acc"]) != acc:
            fail(f"mc doc {s['doc_id']}: acc lm-eval {s['acc']} vs argmax {acc}")
        if "acc_norm" in s and float(s["acc_norm"]) != accn:
            fail(f"mc doc {s['doc_id']}: acc_norm lm-eval {s['acc_norm']} vs argmax {accn}")
    for key, vals in (("acc,none", accs), ("acc_norm,none", accns)):
        mine = sum(vals) / len(vals)
        if key in agg and not close(agg[key], mine, 1e-12):
            fail(f"mc aggregate {key}: lm-eval {agg[key]} vs recomputed {mine}")
    print(f"  mc: {len(samples)} docs, {sum(len(s['resps']) for s in samples)} loglikelihoods, "
          f"acc={sum(accs)/len(accs):.4f} acc_norm={sum(accns)/len(accns):.4f}")


def check_rolling(srv, samples, agg, L, tokenized, prefix, rtol):
    tot_ll = tot_words = tot_bytes = 0.0
    n_win = 0
    for s in samples:
        text = s["arguments"]["gen_args_0"]["arg_0"]
        g_ll = float(s["resps"][0][0])
        toks = srv.enc(text)
        wins = rolling_windows(toks, prefix, L - 1, 1)
        if sum(len(b) for _, b in wins) != len(toks):
            fail(f"rolling doc {s['doc_id']}: windows score {sum(len(b) for _, b in wins)} of {len(toks)} tokens")
        ll = 0.0
        for a, b in wins:
            ids = expected_ids(srv, a + b, tokenized)
            ll += sum(srv.score([ids])[0][len(a):])
        n_win += len(wins)
        if not close(ll, g_ll, rtol):
            fail(f"rolling doc {s['doc_id']}: lm-eval {g_ll!r} vs /score {ll!r}")
        page = s["doc"]["page"]
        words, nbytes = len(re.split(r"\s+", page)), len(page.encode("utf-8"))
        if "word_perplexity" in s and int(s["word_perplexity"][1]) != words:
            fail(f"rolling doc {s['doc_id']}: word count {s['word_perplexity'][1]} vs {words}")
        tot_ll += ll
        tot_words += words
        tot_bytes += nbytes
    mine = {"word_perplexity,none": math.exp(-tot_ll / tot_words),
            "byte_perplexity,none": math.exp(-tot_ll / tot_bytes),
            "bits_per_byte,none": -tot_ll / tot_bytes / math.log(2)}
    for k, v in mine.items():
        if k not in agg:
            fail(f"rolling aggregate {k} missing from results")
        elif not close(float(agg[k]), v, rtol):
            fail(f"rolling aggregate {k}: lm-eval {agg[k]} vs recomputed {v}")
    print(f"  rolling: {len(samples)} docs, {n_win} windows, total ll {tot_ll:.6f}, "
          + ", ".join(f"{k.split(',')[0]}={v:.6g}" for k, v in mine.items()))


def protocol_checks(srv, prefix, rtol):
    """What lm-eval's parse_logprobs silently relies on."""
    ids_a = srv.enc("Robert Boulter is an English film , television and theatre actor .")
    ids_b = srv.enc(" He had a guest role")
    out = srv.completions([ids_a, ids_b], max_tokens=1, logprobs=1)
    ch = sorted(out["choices"], key=lambda c: c["index"])
    if [c["index"] for c in ch] != [0, 1]:
        fail(f"choices indices {[c['index'] for c in out['choices']]}")
    for ids, c in zip((ids_a, ids_b), ch):
        lp = c["logprobs"]
        n = len(ids) + 1
        for f in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            if len(lp.get(f) or []) != n:
                fail(f"echo+max_tokens=1: len({f}) = {len(lp.get(f) or [])}, want prompt+1 = {n}")
        if lp["token_logprobs"][0] is not None:
            fail("echo: token_logprobs[0] must be null")
        ref = srv.score([ids])[0]
        for i in range(1, len(ids)):
            if not close(lp["token_logprobs"][i], ref[i], rtol):
                fail(f"completions token_logprobs[{i}] {lp['token_logprobs'][i]} != /score {ref[i]}")
            top = lp["top_logprobs"][i]
            if max(top.values()) < lp["token_logprobs"][i] - 1e-6:
                fail(f"top_logprobs[{i}] max {max(top.values())} < token logprob {lp['token_logprobs'][i]}")
        g = lp["token_logprobs"][-1]
        if g != max(lp["top_logprobs"][-1].values()):
            fail("appended greedy token: its logprob must equal max(top_logprobs[-1]) exactly")
    # string prompt: does the server add BOS? (lm-eval tokenized_requests=false needs: no)
    s = "Hello world"
    c = srv.completions(s, max_tokens=0, logprobs=1)["choices"][0]["logprobs"]
    plain = srv.enc(s)
    if len(c["tokens"]) == len(plain) + 1:
        WARNS.append("string prompts get a BOS prepended by /v1/completions: lm-eval "
                     "tokenized_requests=false results will be shifted by one token")
    elif len(c["tokens"]) != len(plain):
        fail(f"string prompt echo has {len(c['tokens'])} tokens, /tokenize says {len(plain)}")


def openai_check(url, model, rtol):
    import openai
    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="EMPTY")
    srv = Server(url, model)
    r = client.completions.create(model=model, prompt="Hello world", echo=True, logprobs=1,
                                  max_tokens=0, temperature=0)
    lp = r.choices[0].logprobs
    n = len(lp.tokens)
    plain = srv.enc("Hello world")
    ids = plain if n == len(plain) else [prefix_of(srv)] + plain
    if len(ids) != n:
        fail(f"openai: echo returned {n} tokens, expected {len(plain)} (or +1 with BOS)")
        return
    ref = srv.score([ids])[0]
    if lp.token_logprobs[0] is not None:
        fail("openai: token_logprobs[0] should be None")
    for i in range(1, n):
        if not close(lp.token_logprobs[i], ref[i], rtol):
            fail(f"openai: token_logprobs[{i}] {lp.token_logprobs[i]} != /score {ref[i]}")
    # same through token ids
    r2 = client.completions.create(model=model, prompt=[ids], echo=True, logprobs=1, max_tokens=0)
    if [x for x in r2.choices[0].logprobs.token_logprobs] != list(lp.token_logprobs):
        fail("openai: token-id prompt and string prompt give different token_logprobs")
    print(f"  openai client {openai.__version__}: 'Hello world' -> {n} tokens "
          f"({'BOS added' if n != len(plain) else 'no BOS'}), token_logprobs match /score")


def prefix_of(srv):
    info = srv.get("/tokenizer_info")
    bos = info.get("bos_token") or info.get("eos_token")
    return srv.enc(bos)[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-path")
    ap.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", default=None)
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--max-length", type=int, default=None)
    ap.add_argument("--tokenized-requests", choices=["true", "false"], default=None)
    ap.add_argument("--tokenizer-json", default=None, help="also compare /tokenize with this tokenizer.json")
    ap.add_argument("--openai-check", action="store_true")
    ap.add_argument("--strict-warnings", action="store_true", help="treat warnings as failures")
    a = ap.parse_args()

    model = a.model
    if a.output_path:
        results, samples = load_run(a.output_path)
        margs = results["config"]["model_args"]
        if isinstance(margs, str):
            margs = dict(kv.split("=", 1) for kv in margs.split(",") if kv)
        model = model or margs.get("model")
        L = (a.max_length or int(margs.get("max_length", 2048))) - 1
        tokenized = as_bool(a.tokenized_requests if a.tokenized_requests else margs.get("tokenized_requests", True))
        backend = margs.get("tokenizer_backend", "auto")
        if as_bool(margs.get("add_bos_token", False)):
            sys.exit("check.py assumes add_bos_token=False (the default)")
        srv = Server(a.url, model, a.tokenizer_json)
        prefix = int(margs["custom_prefix_token_id"]) if margs.get("custom_prefix_token_id") else prefix_of(srv)
        print(f"check {a.output_path}: tokenized_requests={tokenized} max_length={L + 1} "
              f"backend={backend} batch_size={results['config'].get('batch_size')} "
              f"num_concurrent={margs.get('num_concurrent', 1)} prefix_token={prefix}")
        protocol_checks(srv, prefix, a.rtol)
        for task, ss in sorted(samples.items()):
            agg = results["results"].get(task, {})
            otype = results["configs"][task]["output_type"]
            if otype == "multiple_choice":
                check_mc(srv, ss, agg, L, tokenized, prefix, a.rtol)
            elif otype == "loglikelihood":
                check_loglik(srv, ss, agg, L, tokenized, prefix, a.rtol)
            elif otype == "loglikelihood_rolling":
                check_rolling(srv, ss, agg, L, tokenized, prefix, a.rtol)
            else:
                print(f"  {task}: output_type {otype} not checked")
        if not samples:
            fail("no samples_*.jsonl found (run lm_eval with --log_samples)")
    if a.openai_check:
        openai_check(a.url, model or "default", a.rtol)
    for w in sorted(set(WARNS)):
        print(f"WARNING: {w} (x{WARNS.count(w)})")
    if a.strict_warnings and WARNS:
        FAILS.extend(WARNS)
    if FAILS:
        print(f"FAIL: {len(FAILS)} mismatches")
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
