"""Summarise a ``py-spy record --format raw`` profile: inclusive share of each function.

    .venv/bin/python bench/pyspy_summary.py PROFILE.txt [--top 40] [--match REGEX]

``bench/gateway.py --profile`` writes one such file per Steep server (all
workers, under load at the largest connection count). Each line of the file is
a collapsed stack and a sample count; a function's inclusive share is the
fraction of samples with it anywhere on the stack (counted once per stack).
"""

from __future__ import annotations

import argparse
import collections
import re


def summarise(path: str, top: int, match: str | None) -> None:
    inclusive: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            line = line.rstrip()
            if not line or " " not in line:
                continue
            stack, count_text = line.rsplit(" ", 1)
            count = int(count_text)
            frames = [re.sub(r":\d+\)$", ")", frame) for frame in stack.split(";")]
            total += count
            for frame in set(frames[1:]):  # frames[0] is the process/thread
                inclusive[frame] += count
            leaf[frames[-1]] += count
    print(f"{total} samples in {path}")
    if not total:
        return
    pattern = re.compile(match) if match else None
    shown = 0
    print("\ninclusive (function anywhere on the stack):")
    for frame, count in inclusive.most_common():
        if pattern and not pattern.search(frame):
            continue
        print(f"{count:8d} {100 * count / total:5.1f}%  {frame}")
        shown += 1
        if shown >= top:
            break
    print("\nself (function at the top of the stack):")
    for frame, count in leaf.most_common(top // 2):
        print(f"{count:8d} {100 * count / total:5.1f}%  {frame}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--match", help="only functions whose name/file matches this regex")
    a = p.parse_args(argv)
    summarise(a.profile, a.top, a.match)


if __name__ == "__main__":
    main()
