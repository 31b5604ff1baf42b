"""Offline loader for the opweave_ll task: reads opweave_ll.jsonl next to this file (no hub, no cwd)."""

import json
import os

import datasets


def load(**kwargs):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "opweave_ll.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
