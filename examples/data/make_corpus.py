"""Writes ``tiny_tales.txt``: short English-like stories from a small template grammar.

The demo needs text that ships with the repository (no downloads), carries no licence
questions, and has enough structure for a small character-level GPT to learn visibly in a few
minutes on a CPU: spelling, word order, punctuation, quotes, and names that recur within a story.
Everything here is generated, deterministically (fixed seed), so the file can be re-created and
checked: ``python examples/data/make_corpus.py && git diff --stat examples/data``. The generated
text is dedicated to the public domain (CC0).

Usage:
  python examples/data/make_corpus.py [--kb 240] [--seed 0] [--out examples/data/tiny_tales.txt]
"""

from __future__ import annotations

import argparse
import os
import random

NAMES = [
    "Anna",
    "Ben",
    "Clara",
    "Daniel",
    "Ella",
    "Finn",
    "Grace",
    "Hugo",
    "Ida",
    "Jonas",
    "Lena",
    "Max",
    "Nora",
    "Oskar",
    "Rosa",
    "Sam",
    "Tilda",
    "Victor",
]
ANIMALS = ["fox", "cat", "dog", "owl", "bear", "rabbit", "mouse", "duck", "horse", "goat", "frog", "crow"]
ADJS = [
    "little",
    "old",
    "brave",
    "quiet",
    "clever",
    "happy",
    "tired",
    "small",
    "big",
    "kind",
    "shy",
    "curious",
    "hungry",
    "sleepy",
    "proud",
    "gentle",
]
COLOURS = ["red", "blue", "green", "yellow", "brown", "white", "black", "grey"]
PLACES = [
    "forest",
    "river",
    "garden",
    "village",
    "hill",
    "lake",
    "meadow",
    "barn",
    "bridge",
    "market",
    "castle",
    "beach",
]
THINGS = [
    "apple",
    "ball",
    "book",
    "hat",
    "kite",
    "basket",
    "lamp",
    "key",
    "boat",
    "cake",
    "drum",
    "map",
    "shell",
    "stone",
    "flower",
    "letter",
]
WALK = ["walked", "ran", "hopped", "wandered", "hurried", "climbed", "went", "raced"]
FEEL = ["happy", "sad", "surprised", "scared", "glad", "proud", "sleepy", "hungry"]
TIMES = [
    "In the morning",
    "One day",
    "After lunch",
    "At night",
    "On a rainy day",
    "Later that day",
    "At sunset",
    "Early in the spring",
]
WEATHER = [
    "The sun was warm.",
    "The wind was cold.",
    "It began to rain.",
    "The sky was clear and blue.",
    "Snow fell on the roofs.",
    "The air smelled of bread.",
]
SAY = ["said", "asked", "whispered", "shouted", "called"]


def a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


class Story:
    def __init__(self, rng: random.Random):
        self.rng = rng
        self.hero = rng.choice(NAMES)
        self.friend = rng.choice([n for n in NAMES if n != self.hero])
        self.animal = rng.choice(ANIMALS)
        self.adj = rng.choice(ADJS)
        self.place = rng.choice(PLACES)
        self.thing = rng.choice(THINGS)
        self.colour = rng.choice(COLOURS)

    def c(self, xs):
        return self.rng.choice(xs)

    def opening(self) -> str:
        return self.c(
            [
                f"Once upon a time there was {a(self.adj)} {self.animal} who lived near the {self.place}.",
                f"{self.hero} had {a(self.colour)} {self.thing} and {a(self.adj)} {self.animal}.",
                f"{self.c(TIMES)}, {self.hero} {self.c(WALK)} to the {self.place} with {self.friend}.",
            ]
        )

    def middle(self) -> str:
        r = self.rng.random()
        if r < 0.25:
            return f"{self.c(TIMES)}, the {self.animal} {self.c(WALK)} to the {self.c(PLACES)} to look for {a(self.c(THINGS))}."
        if r < 0.45:
            return (
                f'"Where is my {self.thing}?" {self.c(SAY)} {self.hero}. '
                f'"I saw it by the {self.c(PLACES)}," {self.c(SAY)} {self.friend}.'
            )
        if r < 0.6:
            return self.c(WEATHER)
        if r < 0.75:
            return f"{self.hero} felt {self.c(FEEL)}, so {self.c(['she', 'he', 'they'])} sat down by the {self.place}."
        if r < 0.9:
            n = self.rng.randint(2, 9)
            return f"The {self.animal} found {n} {self.c(THINGS)}s and gave one to {self.friend}."
        return f'"Can we go to the {self.c(PLACES)} tomorrow?" {self.c(SAY)} {self.friend}. "Yes," said {self.hero}.'

    def ending(self) -> str:
        return self.c(
            [
                f"In the end, {self.hero} and the {self.animal} were {self.c(FEEL)} and went home.",
                f"They found the {self.colour} {self.thing} under a tree, and everyone laughed.",
                f"That night the {self.adj} {self.animal} slept well by the {self.place}.",
                f"And so {self.hero} and {self.friend} became good friends.",
            ]
        )

    def text(self) -> str:
        body = [self.middle() for _ in range(self.rng.randint(2, 5))]
        return " ".join([self.opening(), *body, self.ending()])


def make(kb: int, seed: int) -> str:
    rng = random.Random(seed)
    stories, size = [], 0
    while size < kb * 1024:
        s = Story(rng).text()
        stories.append(s)
        size += len(s) + 2
    return "\n\n".join(stories) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kb", type=int, default=240, help="approximate size in KiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_tales.txt"))
    args = ap.parse_args()
    text = make(args.kb, args.seed)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}: {len(text)} characters, {len(set(text))} distinct")


if __name__ == "__main__":
    main()
