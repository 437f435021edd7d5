"""The conversations the harness runs, written for this repository.

A session is a scripted chat: the first user turn is prefilled, the model answers each
user turn greedily with the full cache (at most `cap` tokens, or until <|im_end|>), the
next user turn follows, and so on. Every compressed configuration is fed the same tokens
(teacher forcing). At the end each probe question is asked on its own copy of every
cache, each configuration answering greedily for itself; a probe is answered right when
the answer contains one of its accepted strings.

Facts are planted in the first turn and asked after all the other turns, so that
between the plant and the question lie well over a thousand tokens: far more than the
smaller budgets hold. Only facts the full cache itself answers right are asked: the
lighthouse keeper's name (three phrasings: the model named a later character) and the
user's own name (three phrasings: it answered with a name of its own) were tried and
dropped, since a miss there says nothing about compression.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Turn:
    user: str
    cap: int  # most tokens the assistant answer may take


@dataclasses.dataclass(frozen=True)
class Probe:
    question: str
    accept: tuple[str, ...]  # any of these (case-insensitive) in the answer counts as right


@dataclasses.dataclass(frozen=True)
class Session:
    name: str
    turns: tuple[Turn, ...]
    probes: tuple[Probe, ...]


LIGHTHOUSE = """Please read this story carefully. I will ask you about its details much later.

The lighthouse on Gull Point was kept by a woman named Edda Varn. She had lived there for nineteen years with her grey cat, Pepper, and a green rowing boat she called the Moth. Every Sunday she rowed the Moth across the bay to the village of Saltmere to buy flour, lamp oil and a newspaper. The spare key to the lamp room was hidden inside a tin of cocoa on the kitchen shelf, because Edda believed no thief would ever look there.

One autumn evening a storm came in from the west. The wind pulled slates off the roof of the boathouse, and the rain came sideways against the windows. Edda climbed the one hundred and twelve steps to the lamp room, trimmed the wick and polished the great lens until it shone. Far out on the water she saw the lights of a fishing boat, the Kestrel, struggling against the waves. The Kestrel's engine had failed, and its crew of three were trying to row towards the harbour.

Edda rang the storm bell twice, the signal that the rocks at the mouth of the bay were close. The crew of the Kestrel heard it and turned north, away from the rocks. For two hours Edda kept the lamp burning and the bell ringing, while Pepper slept on the warm stones beside the stove downstairs. At last the Kestrel reached the calm water behind the harbour wall, and its crew tied up at the village pier.

The next morning the three fishermen rowed out to Gull Point to thank her. They brought a basket of smoked fish, a jar of honey and a new brass bell for the boathouse. The youngest of them, a boy called Tomas, asked Edda how she had learned to keep a lighthouse. She told him that her father had kept the same light before her, and that he had taught her to read the sky, to count the seconds between the flashes of distant lights, and never to let the lamp go out.

Tell me in a few sentences what happens in this story."""

STORY = Session(
    name="story",
    turns=(
        Turn(LIGHTHOUSE, 160),
        Turn("Continue the story: write what happens the following winter, when the bay freezes over.", 220),
        Turn(
            "Now a short arithmetic question. Edda buys 3 bags of flour at 4 dollars each and 2 cans "
            "of lamp oil at 7 dollars each. How much does she spend in total? Work it out step by step.",
            200,
        ),
        Turn("Write a short poem about the sea at night.", 160),
        Turn("Describe, in a paragraph, how a lighthouse lens works.", 200),
        Turn("Continue the story again: Tomas decides to become a lighthouse keeper. What does he do first?", 220),
    ),
    probes=(
        Probe("In the story I gave you at the start, what was the name of Edda's cat?", ("Pepper",)),
        Probe("In the story I gave you at the start, what was the name of Edda's boat?", ("Moth",)),
        Probe("In the story I gave you at the start, where was the spare key to the lamp room hidden?", ("cocoa",)),
        Probe("In the story I gave you at the start, what was the name of the fishing boat in the storm?", ("Kestrel",)),
    ),
)

ARITHMETIC = Session(
    name="arithmetic",
    turns=(
        Turn(
            "My name is Ilona and I run a bakery called The Copper Whisk. I will give you some word "
            "problems from my bakery. Solve each one step by step, showing your work.\n\n"
            "Problem 1: I bake 12 trays of rolls, and each tray holds 15 rolls. I sell 137 rolls "
            "in the morning. How many rolls are left?",
            240,
        ),
        Turn(
            "Problem 2: A bag of flour weighs 25 kilograms. One loaf of bread needs 400 grams of flour. "
            "How many whole loaves can I bake from 3 bags?",
            240,
        ),
        Turn(
            "Problem 3: A cake costs 18 dollars. On Saturday I sold 23 cakes, and on Sunday I sold 9 "
            "more cakes than on Saturday. How much money did the cakes bring in over the weekend?",
            240,
        ),
        Turn(
            "Problem 4: My oven uses 3 kilowatt-hours per hour. It runs 9 hours a day, 6 days a week, "
            "and electricity costs 20 cents per kilowatt-hour. What does the oven cost to run each week?",
            240,
        ),
        Turn(
            "Problem 5: I pay my two assistants 14 dollars per hour. One works 30 hours a week and the "
            "other works 25 hours. How much do I pay them together in 4 weeks?",
            240,
        ),
    ),
    probes=(
        Probe("What is the name of my bakery?", ("Copper Whisk",)),
    ),
)

SESSIONS = (STORY, ARITHMETIC)
