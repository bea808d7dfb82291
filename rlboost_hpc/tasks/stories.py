"""The stories260K demo task: make a tiny TinyStories model put dialogue (a quotation mark) in its stories.

Verified on this machine (``../shared/notes/demo-task.md``): with GRPO (8 prompts x group 8, temperature 1,
48 new tokens, AdamW lr 3e-5) the held-out sampled reward climbs from ~0.12 to ~0.9 in 50 steps while the
text stays story-like.

Invariants:
- The prompts are the fixed list :data:`OPENINGS` of natural TinyStories-style story openings: unique, no
  ``"`` character (the reward is earned by the continuation, never given by the prompt), no leading or
  trailing whitespace (a trailing space would become an unusual lone ``▁`` token). Changing the list (even
  appending to it) changes the split, so results across such a change are not comparable; a pinned
  digest in the tests makes that change deliberate.
- The split is a seeded shuffle of :data:`OPENINGS`: first ``n_train`` for training, next ``n_heldout`` held
  out; deterministic, disjoint. A prompt's ``pid`` is derived from its text (``stories/<sha1[:10]>``), so
  it does not depend on the split sizes.
- Reward (pure, in {0.0, 1.0}): 1.0 iff the continuation contains a ``"`` (straight double quote; curly
  quotes do not count); with ``strict=True``, iff it contains a *closed* quotation ``"…"`` whose inside
  has at least one letter. The continuation is the new text only, with the stop token already removed
  by the caller (stories260K ends stories with BOS, id 1, not EOS).
- :func:`repetition_rate` is a quality monitor next to the reward (quote rewards can be gamed by
  degenerate output such as ``" " "``); it is not part of the reward.
"""
from __future__ import annotations

import hashlib
import random
import re

from rlboost_hpc.tasks.base import Prompt, Task

__all__ = ["OPENINGS", "StoryQuoteTask", "quote_reward", "repetition_rate"]

#: TinyStories-style story openings (changing them changes the split; see the module docstring).
OPENINGS: tuple[str, ...] = (
    "Once upon a time, there was a little",
    "One day, a boy named",
    "Lily and her mom went to the",
    "Tom had a big red",
    "Once upon a time, in a big forest, there lived a",
    "One sunny day, Sue went to the park with her",
    "There was once a small cat who liked to",
    "Ben and his dad went to the store to buy",
    "Once upon a time, there was a girl named Mia. She loved to",
    "One day, a little bird found a shiny",
    "Sam was a happy dog. Every morning he",
    "Anna wanted to play with her new",
    "Once upon a time, there was a big, friendly",
    "Max and Lily were best friends. One day they",
    "It was a rainy day, and Tim could not go",
    "There was a little boy who had a blue",
    "Mom gave Lucy a big box. Inside the box was a",
    "One morning, a little frog jumped out of the",
    "Once upon a time, a kind old man lived in a small",
    "The sun was shining and the birds were singing. Jack ran to the",
    "Emma found a tiny key under her",
    "Once there was a brave little mouse named",
    "One day, Timmy saw a big truck on the",
    "Sara liked to draw pictures of",
    "In a small town, there was a baker who made",
    "Once upon a time, there was a lazy cat who",
    "Lily saw a pretty butterfly in the garden. She wanted to",
    "Tom and his sister went to the beach. They",
    "One night, Ben looked up at the sky and saw",
    "There was a big tree in the park. Under the tree,",
    "Once upon a time, a little girl named Sue had a",
    "The little duck wanted to swim in the",
    "Mia had a red ball. She liked to throw it",
    "One day, a fox and a rabbit met in the",
    "Once upon a time, there was a small house with a",
    "Jack liked to build towers with his",
    "It was Lily's birthday, and her mom made a",
    "Once upon a time, a little bear woke up and felt",
    "Tim went to school with his new",
    "Once upon a time, there was a little car named",
    "One day, Sam found a lost puppy near the",
    "There once lived a silly monkey who loved",
    "Anna and her grandma baked cookies. They put",
    "One day, the wind blew very hard and the",
    "Once upon a time, there was a princess who lived in a",
    "Ben was sad because his toy was",
    "The dog ran fast to catch the",
    "Lucy went for a walk in the woods and saw",
    "Once upon a time, there was a tiny ant who",
    "One day, Mom and Dad took Tim to the zoo. They saw",
    "A little girl named Amy had a doll. Every day she",
    "There was a boat on the lake. A boy named",
    "Once upon a time, in a small village, there was a",
    "Max found a big stick in the yard and",
    "It was a cold winter day. Lily put on her",
    "One day, a big bird flew down to the",
    "Sue and Tom were playing with blocks when",
    "Once upon a time, a little fish lived in a",
    "Jack was very hungry. He went to the kitchen and",
    "Once upon a time, there was a happy sun who",
    "Mia and her friend found a hole in the",
    "The old owl lived in a tall tree. Every night he",
    "One day, Lily's dad gave her a",
    "Tim saw a big puddle and wanted to",
    "Once upon a time, there was a shy little bunny who",
    "Sara wanted to help her mom clean the",
    "Ben had a best friend named",
    "One day, a small girl named Kim went to the",
    "There was a little train that went up the",
    "Once upon a time, a dog named Spot found a",
    "Lucy loved to sing. Every day she",
    "Tom looked out of the window and saw",
    "Once upon a time, there was a big green",
    "One day, the animals in the forest decided to",
    "Anna had a small garden where she grew",
    "Max wanted to fly like a bird, so he",
    "Once upon a time, there was a boy who did not like to",
    "It was time for bed, but Lily did not want to",
    "One day, a little cloud was floating in the",
    "Sam and his mom made a cake for",
    "Once upon a time, a kitten named Fluffy lived in a",
    "Jack and Jill went up the hill to",
    "There was a girl who had a magic",
    "One day, Tim's mom said he could have a",
    "Once upon a time, there was a little star who",
    "Lily and Ben went to the farm. They saw a",
    "The little elephant was sad because",
    "Emma liked to read books about",
    "One day, a girl named Lucy found a box in the",
    "Once upon a time, there was an old lady who had a",
    "Tom wanted to play outside, but his mom said",
    "One day, Sue lost her favorite",
    "Once upon a time, a small boat sailed on the",
    "Mia went to the park and met a new",
    "There was a big hill near the house. Every day, Ben",
    "Once upon a time, there was a little robot who",
    "One day, a squirrel named Sammy found a",
    "Lily's brother was playing with a ball when",
    "Once upon a time, a happy family lived in a",
    "Tim and his dog went on a walk to the",
    "One day, a little girl named Zoe wanted to",
    "The toy box was full of toys. Anna picked up the",
    "Once upon a time, there was a grumpy old",
    "Ben and Sara found a map that showed",
)


def _pid(text: str) -> str:
    return "stories/" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:10]


_CLOSED_QUOTE_WITH_LETTER = re.compile(r'"[^"]*[A-Za-z][^"]*"')


def quote_reward(text: str, strict: bool = False) -> float:
    """1.0 if ``text`` contains a ``"`` (``strict``: a closed ``"…"`` with a letter inside), else 0.0."""
    if strict:
        return 1.0 if _CLOSED_QUOTE_WITH_LETTER.search(text) else 0.0
    return 1.0 if '"' in text else 0.0


_WORD = re.compile(r"\w+|[^\w\s]")


def repetition_rate(text: str) -> float:
    """Share of repeated word 3-grams in ``text``, in ``[0, 1]``.

    Words are lower-cased runs of letters/digits, and each punctuation mark counts as a word of its own
    (so degenerate output such as ``" " " "`` or ``,,,,`` scores high). The rate is
    ``1 - distinct 3-grams / all 3-grams``: 0.0 for text without repeats (or shorter than three words),
    about 0.78 for ``"went to the park "`` repeated five times, approaching 1 for endless repetition.
    """
    words = _WORD.findall(text.lower())
    if len(words) < 3:
        return 0.0
    grams = [tuple(words[i : i + 3]) for i in range(len(words) - 2)]
    return 1.0 - len(set(grams)) / len(grams)


class StoryQuoteTask(Task):
    """The stories260K demo: continue a story opening; reward 1 when the continuation has a quotation mark.

    Args:
        n_train: number of training prompts (default 64).
        n_heldout: number of held-out prompts (default 32).
        strict: reward only a closed quotation containing a letter (the stricter second check).
        seed: seed of the split shuffle (default 0; the verified demo setting).

    Raises:
        ValueError: a size is below 1 or ``n_train + n_heldout`` exceeds ``len(OPENINGS)``.

    Source: ``../shared/notes/demo-task.md`` (the verified demo setting).
    """

    name = "stories"
    stop_strings: tuple[str, ...] = ()

    def __init__(self, n_train: int = 64, n_heldout: int = 32, strict: bool = False, seed: int = 0) -> None:
        if n_train < 1 or n_heldout < 1:
            raise ValueError(f"n_train and n_heldout must be >= 1 (got {n_train}, {n_heldout})")
        if n_train + n_heldout > len(OPENINGS):
            raise ValueError(
                f"n_train + n_heldout = {n_train + n_heldout} exceeds the {len(OPENINGS)} available openings"
            )
        self.n_train = n_train
        self.n_heldout = n_heldout
        self.strict = strict
        self.seed = seed
        order = list(range(len(OPENINGS)))
        random.Random(seed).shuffle(order)
        prompts = [Prompt(pid=_pid(OPENINGS[i]), text=OPENINGS[i], meta={}) for i in order]
        self._train = tuple(prompts[:n_train])
        self._heldout = tuple(prompts[n_train : n_train + n_heldout])

    def train_prompts(self) -> list[Prompt]:
        return list(self._train)

    def heldout_prompts(self) -> list[Prompt]:
        return list(self._heldout)

    def reward(self, prompt: Prompt, response_text: str) -> float:
        """:func:`quote_reward` of the continuation (``strict`` as configured); ``prompt`` is unused."""
        return quote_reward(response_text, strict=self.strict)

    def __repr__(self) -> str:
        return (
            f"StoryQuoteTask(n_train={self.n_train}, n_heldout={self.n_heldout}, "
            f"strict={self.strict}, seed={self.seed})"
        )
