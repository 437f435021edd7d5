"""Tasks with exact answers, generated deterministically from seeds.

- **Needle**: a fact (a person's locker number, four digits) planted at a depth of 10-90%
  of a context of filler prose, the question asked at the end. Right when the answer
  holds the number.
- **Arithmetic**: two quantities planted at two depths of the same kind of context, and a
  short word problem asked at the end whose answer needs both (a sum, a difference or a
  product); right when the last number of the answer is the result.

The filler is prose assembled from pools of subjects, actions, objects and places, so
that long contexts repeat few 8-grams (the report measures it). A context's length is
counted in the model's tokens (`count`: text -> tokens), so the same seed and length give
the same text for every run. Each configuration answers for itself (free-running
generation); tasks the full cache gets wrong are kept in the results but left out of the
accuracy (they say nothing about compression).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

SUBJECTS = (
    "The ferry captain", "A retired geologist", "The night porter", "Our neighbour's daughter", "The choir director",
    "A tired courier", "The orchard keeper", "An old clockmaker", "The youngest apprentice", "A visiting botanist",
    "The harbour pilot", "The museum guard", "A quiet librarian", "The bus driver", "A travelling tailor",
    "The head gardener", "The village baker", "A cheerful postman", "The beekeeper", "The radio operator",
    "A patient carpenter", "The school nurse", "The mapmaker", "A shy violinist", "The lighthouse mechanic",
    "The market inspector", "A young painter", "The weather observer", "The stable hand", "The bookbinder",
)
ACTIONS = (
    "repaired", "counted", "painted", "carried", "sorted", "polished", "measured", "wrapped", "inspected", "labelled",
    "folded", "sketched", "weighed", "cleaned", "stacked", "returned", "borrowed", "described", "photographed",
    "tested",
)
OBJECTS = (
    "a crate of copper pipes", "the broken weather vane", "three blue lanterns", "a stack of old maps",
    "the cracked church window", "a basket of winter pears", "two rolls of sailcloth", "the station's brass clock",
    "a box of seed packets", "the rusty garden gate", "a dozen glass jars", "the faded theatre posters",
    "a bundle of birch twigs", "the last ferry tickets", "a pile of wool blankets", "the wooden chess set",
    "a bag of river stones", "the tin soldiers", "a shelf of recipe books", "the cracked teapot",
    "four iron hinges", "a jar of plum jam", "the green bicycle", "a set of brass keys", "the torn fishing net",
)
PLACES = (
    "near the north pier", "behind the old mill", "in the covered market", "beside the railway bridge",
    "at the edge of the pine wood", "in the attic of the town hall", "under the stone arch", "by the frozen pond",
    "in the back room of the pharmacy", "on the second floor of the library", "outside the fire station",
    "along the canal towpath", "in the courtyard of the inn", "next to the bakery", "at the top of Mill Lane",
    "inside the greenhouse", "on the hill above the harbour", "in the school gymnasium", "beside the chapel",
    "at the bottom of the quarry",
)
TIMES = (
    "early on Monday", "just before noon", "late in the evening", "after the storm", "during the fair",
    "on a foggy morning", "at sunset", "while it rained", "before the bells rang", "on the first warm day",
    "in the middle of the night", "after lunch",
)
CODAS = (
    "Nobody asked why.", "It took longer than expected.", "A small crowd watched.", "The work was finished by dark.",
    "Two dogs followed the whole way.", "The wind made it harder.", "Everyone agreed it was worth it.",
    "A note was left on the door.", "The radio played quietly nearby.", "It was done without a single word.",
    "The smell of bread drifted past.", "Someone hummed an old song.", "", "", "", "",
)
NAMES = ("Anouk", "Bastian", "Corra", "Dmitri", "Elspeth", "Farid", "Greta", "Hollis", "Ines", "Jarek", "Kirsi",
         "Lorcan", "Maelis", "Niamh", "Oskar", "Petra", "Quill", "Rosalind", "Soren", "Talia")
GOODS = (("crates of apples", "crates"), ("sacks of rice", "sacks"), ("boxes of nails", "boxes"),
         ("barrels of cider", "barrels"), ("bundles of firewood", "bundles"), ("rolls of wire", "rolls"))


@dataclasses.dataclass(frozen=True)
class Task:
    kind: str  # "needle" | "arithmetic"
    seed: int
    context_tokens: int  # the filler's target length in tokens
    depths: tuple[float, ...]  # where the fact(s) sit, as fractions of the context
    prompt: str  # the whole user turn: context, then the question
    question: str
    answer: str  # the number that is right


def filler_sentence(rng: np.random.Generator) -> str:
    s = (f"{SUBJECTS[rng.integers(len(SUBJECTS))]} {ACTIONS[rng.integers(len(ACTIONS))]} "
         f"{OBJECTS[rng.integers(len(OBJECTS))]} {PLACES[rng.integers(len(PLACES))]} {TIMES[rng.integers(len(TIMES))]}.")
    coda = CODAS[rng.integers(len(CODAS))]
    return s + (" " + coda if coda else "")


def _context(rng: np.random.Generator, tokens: int, facts: list[tuple[float, str]], count) -> str:
    """Filler of about `tokens` tokens with each fact inserted at the sentence boundary
    nearest its depth (a fraction of the filler's tokens)."""
    sents, lens, total = [], [], 0
    while total < tokens:
        s = filler_sentence(rng)
        n = count(" " + s)
        sents.append(s), lens.append(n)
        total += n
    cum = np.cumsum([0] + lens)
    out = list(sents)
    for depth, fact in sorted(facts, reverse=True):  # from the back, so earlier indices stay valid
        at = int(np.argmin(np.abs(cum - depth * total)))
        out.insert(at, fact)
    paras, para = [], []
    for i, s in enumerate(out):  # paragraphs of about six sentences
        para.append(s)
        if len(para) >= 6 or i == len(out) - 1:
            paras.append(" ".join(para))
            para = []
    return "\n\n".join(paras)


def needle(seed: int, tokens: int, depth: float, count) -> Task:
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle: depth must be in [0, 1], got {depth}")
    rng = np.random.default_rng([1, seed, tokens, int(round(depth * 1000))])
    name = NAMES[rng.integers(len(NAMES))]
    number = str(int(rng.integers(1000, 10000)))
    fact = f"{name}'s locker at the swimming pool is number {number}."
    ctx = _context(rng, tokens, [(depth, fact)], count)
    q = f"What is the number of {name}'s locker at the swimming pool? Answer with the number."
    prompt = f"Read the following notes. I will ask you one question about them.\n\n{ctx}\n\n{q}"
    return Task("needle", seed, tokens, (depth,), prompt, q, number)


def arithmetic(seed: int, tokens: int, count) -> Task:
    rng = np.random.default_rng([2, seed, tokens])
    goods, unit = GOODS[rng.integers(len(GOODS))]
    a, b = int(rng.integers(12, 60)), int(rng.integers(3, 30))
    d1, d2 = sorted(rng.uniform(0.1, 0.9, size=2).round(2))
    kind = int(rng.integers(3))
    facts = [(float(d1), f"On Monday the warehouse received {a} {goods}."),
             (float(d2), f"On Tuesday the warehouse received {b} {goods}.")]
    if kind == 0:
        q, ans = f"How many {unit} did the warehouse receive on Monday and Tuesday together?", a + b
    elif kind == 1:
        q, ans = f"How many more {unit} did the warehouse receive on Monday than on Tuesday?", a - b
        if ans <= 0:  # keep it a plain subtraction
            facts = [(float(d1), f"On Monday the warehouse received {a + b} {goods}."), facts[1]]
            ans = a
    else:
        m = int(rng.integers(2, 7))
        facts[1] = (float(d2), f"Each of the {unit} weighs {m} kilograms.")
        q, ans = f"How many kilograms did the {unit} received on Monday weigh in total?", a * m
    ctx = _context(rng, tokens, facts, count)
    prompt = (f"Read the following notes. I will ask you one question about them.\n\n{ctx}\n\n{q} "
              "Work it out, then give the final number.")
    return Task("arithmetic", seed, tokens, (float(d1), float(d2)), prompt, q, str(ans))


def numbers_in(text: str) -> list[str]:
    """The numbers in a text, thousands separators dropped: '1,250 and 7.' -> ['1250', '7']."""
    return [m.replace(",", "") for m in re.findall(r"\d[\d,]*", text)]


def is_right(task: Task, answer: str) -> bool:
    nums = numbers_in(answer)
    if task.kind == "needle":
        return task.answer in nums
    return bool(nums) and nums[-1] == task.answer


def build(count, lengths=(1024, 2048, 4096, 6144), depths=(0.1, 0.3, 0.5, 0.7, 0.9), seeds=(0,),
          arithmetic_per_length: int = 2) -> list[Task]:
    """Every (length, depth, seed) needle and `arithmetic_per_length` word problems per
    (length, seed)."""
    out = [needle(s, n, d, count) for n in lengths for d in depths for s in seeds]
    out += [arithmetic(s * 100 + i, n, count) for n in lengths for s in seeds for i in range(arithmetic_per_length)]
    return out
