#!/usr/bin/env python3
"""Dry validation (no model, no server): load the three local task YAMLs, build their docs and requests.
Run from tests/lm-eval/ (data_files are relative): python validate_tasks.py"""
import os
import sys

from lm_eval.tasks import TaskManager, get_task_dict

HERE = os.path.dirname(os.path.abspath(__file__))
os.chdir(HERE)
tm = TaskManager(include_path=os.path.join(HERE, "tasks"))
names = ["exactscore_wikitext_mc", "exactscore_wikitext_lastword", "exactscore_wikitext_rolling"]
tasks = get_task_dict(names, tm)
ok = True
for name in names:
    t = tasks[name]
    docs = list(t.test_docs())
    t.build_all_requests(limit=2, rank=0, world_size=1)
    inst = t.instances
    print(f"{name}: {len(docs)} docs, output_type={t.OUTPUT_TYPE}, {len(inst)} requests for limit=2")
    print("   first request args:", repr(inst[0].args)[:160])
    expect = {"exactscore_wikitext_mc": (20, 8), "exactscore_wikitext_lastword": (12, 2),
              "exactscore_wikitext_rolling": (5, 2)}[name]
    if (len(docs), len(inst)) != expect:
        ok = False
        print("   UNEXPECTED counts, wanted", expect)
sys.exit(0 if ok else 1)
