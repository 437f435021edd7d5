"""The conversations the harness runs, written for this repository.

A session is a scripted chat: the first user turn is prefilled, the full cache answers
each user turn by sampling (harness.py: a temperature and seeds, so each (session, seed)
is one conversation, reproducible), at most `cap` tokens or until <|im_end|>, the next
user turn follows, and so on. Every compressed configuration is fed the same tokens
(teacher forcing). At the end each probe question is asked on its own copy of every
cache, each configuration answering greedily for itself; a probe is answered right when
the answer contains one of its accepted strings.

Facts are planted in the first turn and asked after all the other turns. A probe the
full cache gets wrong says nothing about compression: the report counts, for each
configuration, only the probes the full cache of the same conversation answered right.
(In the story session the lighthouse keeper's name and the user's own name were tried
and dropped for that reason.) The twenty sessions are on different subjects (stories,
instructions, explanations, letters, arithmetic), so they share little text.
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



def _session(name: str, first: str, cap: int, follow: tuple[tuple[str, int], ...], probes: tuple[Probe, ...]) -> Session:
    return Session(name, (Turn(first, cap),) + tuple(Turn(u, c) for u, c in follow), probes)


# Eighteen more, each on a subject of its own (stories, instructions, explanations, letters,
# arithmetic), so the conversations share little text; facts planted in the first turn are
# asked at the end.
MORE = (
    _session(
        "orchard",
        "Here is a short story. Remember its details.\n\nIn the hills above Varda there was an orchard of "
        "ninety plum trees that belonged to two sisters, Mirela and Juno. Mirela kept the accounts in a red "
        "ledger and Juno looked after the trees. Their donkey was called Biscuit, and he pulled the cart to the "
        "market in Varda every Thursday. One summer a hailstorm broke half the branches on the east slope. Juno "
        "climbed every tree to splint the branches with strips of willow, and Mirela sold jam instead of fresh "
        "plums to pay for new ladders. By the next spring the east slope bloomed again.\n\nSummarise the story "
        "in three sentences.",
        140,
        (("Why might jam have been a good thing to sell after the storm? Explain briefly.", 140),
         ("Write the letter Juno might send to a friend about the hailstorm.", 180)),
        (Probe("In the story at the start, what was the donkey called?", ("Biscuit",)),
         Probe("In the story at the start, what colour was the ledger?", ("red",))),
    ),
    _session(
        "recipe",
        "I want to cook lentil soup for six people tonight. I have red lentils, two onions, a carrot, a tin of "
        "tomatoes, cumin, a lemon and vegetable stock. My stove has only one working burner, and my largest pot "
        "holds four litres. Give me clear numbered steps.",
        220,
        (("How could I make the soup spicier without chilli?", 120),
         ("If two more guests come, how should I change the amounts?", 140)),
        (Probe("How many litres does my largest pot hold?", ("four", "4")),),
    ),
    _session(
        "tides",
        "Explain to a twelve-year-old why the sea has two high tides a day. Use the Moon and the Sun in your "
        "explanation, and keep it under two hundred words.",
        220,
        (("What is a spring tide, and when does it happen?", 140),
         ("Give me a simple experiment with a bowl of water that shows something about tides, or explain why "
          "one is hard to do.", 160)),
        (),
    ),
    _session(
        "train_letter",
        "My name is Rasmus Holt and I live at 14 Linden Row. Last Tuesday my train from Dunmore to Kessel was "
        "cancelled, and I had to pay 38 euros for a taxi to reach a job interview. Please write a polite "
        "complaint letter to the railway company asking for a refund of the taxi fare.",
        240,
        (("Make the letter shorter and more direct.", 180),
         ("Now write a two-line text message to my sister saying I made it to the interview.", 60)),
        (Probe("How much did I pay for the taxi?", ("38",)),
         Probe("Which town was my train going to?", ("Kessel",))),
    ),
    _session(
        "garden_plan",
        "I have a small garden bed, two metres by three metres, that gets sun only in the morning. I want to grow "
        "vegetables for a family of three. The soil is heavy clay and it rains a lot here in spring. Suggest what "
        "to plant and how to lay out the bed.",
        220,
        (("What should I do to improve clay soil before planting?", 160),
         ("How much area is the bed, and how much would a path 40 centimetres wide down the middle take up? "
          "Work it out.", 140)),
        (Probe("How many metres long is my garden bed on its longer side?", ("three", "3")),),
    ),
    _session(
        "mystery",
        "Read this short mystery.\n\nAt the Harrow Hotel, a silver music box went missing from room 12 on a "
        "snowy night. Three guests were awake after midnight: Mr Feld, a piano teacher, who said he was reading "
        "in the lounge; Mrs Oduya, who said she was writing letters; and young Pim, the cook's nephew, who was "
        "seen carrying a tray of cocoa upstairs. In the morning the music box was found in the laundry basket on "
        "the second floor, still playing a waltz. Wet footprints led from the back door to the laundry room.\n\n"
        "Who do you think took the music box, and why?",
        200,
        (("What other clue would you look for to be sure?", 140),
         ("Write the scene where the detective explains the answer to the guests.", 220)),
        (Probe("In the mystery at the start, what number was the room the music box went missing from?", ("12",)),
         Probe("In the mystery at the start, where was the music box found?", ("laundry",))),
    ),
    _session(
        "budget",
        "Help me plan a monthly budget. I earn 2400 dollars a month after tax. Rent is 950 dollars, groceries "
        "about 320, transport 110, and my phone 35. I want to save at least 300 dollars a month. How much is "
        "left for everything else? Show the calculation.",
        200,
        (("If my rent goes up by 8 percent, how much less will be left each month?", 160),
         ("Give me three practical ways to spend less on groceries.", 160)),
        (Probe("How much do I pay for my phone each month?", ("35",)),),
    ),
    _session(
        "volcano",
        "Describe what happens inside a volcano before an eruption: where the magma comes from, why it rises and "
        "what the gases do. Then name one warning sign scientists watch for.",
        220,
        (("Why are some eruptions explosive and others gentle?", 180),
         ("Write four lines of rhyming verse about a sleeping volcano.", 80)),
        (),
    ),
    _session(
        "bike_repair",
        "My bicycle's back tyre goes flat every two days. It is a 28-inch wheel with a Presta valve, and I ride "
        "about nine kilometres to work on a gravel road. Walk me through finding and fixing the leak, step by "
        "step.",
        220,
        (("What tools should I carry for repairs on the way to work?", 140),
         ("Is it worth buying puncture-resistant tyres for my commute? Give reasons.", 140)),
        (Probe("What kind of valve does my bicycle's tyre have?", ("Presta",)),),
    ),
    _session(
        "island_story",
        "Write a story with me. The setting: a small island called Tornholm, where the ferry comes only twice a "
        "week. The main character is Saga, an eleven-year-old girl who repairs radios with her grandfather. One "
        "day she picks up a message in Morse code from a ship called the Aurelia. Write the first part of the "
        "story, about two paragraphs.",
        220,
        (("Continue: Saga decodes the message. What does it say, and what does she do?", 220),
         ("Continue: the ferry arrives early. End the story.", 220)),
        (Probe("In our story, what was the name of the island?", ("Tornholm",)),
         Probe("In our story, what was the name of the ship that sent the message?", ("Aurelia",))),
    ),
    _session(
        "study_plan",
        "I have an exam in statistics in 18 days. The topics are probability, distributions, hypothesis tests "
        "and regression. I can study two hours on weekdays and four hours on weekends. Make me a study plan.",
        220,
        (("How many hours of study does the plan give me in total, if today is a Monday? Work it out.", 160),
         ("Explain in simple words what a p-value is.", 140)),
        (Probe("How many days are left until my exam?", ("18", "eighteen")),),
    ),
    _session(
        "bees",
        "Explain how honeybees decide where to build a new nest when a colony swarms. Mention the scouts and the "
        "waggle dance.",
        200,
        (("How do bees keep the hive warm in winter?", 160),
         ("Write a short dialogue between a scout bee and a young worker.", 180)),
        (),
    ),
    _session(
        "moving_day",
        "We are moving house on the 9th of March. We have 46 boxes, a piano, and a cat named Olive who hates the "
        "car. The new flat is on the fourth floor and the lift is small. Help me write a checklist for the day "
        "before and the day of the move.",
        220,
        (("The removal van costs 85 dollars per hour and the move takes 5 hours, plus a fixed fee of 60 dollars "
          "for the piano. What is the total? Show the steps.", 140),
         ("How can I keep the cat calm during the move?", 140)),
        (Probe("What is the name of our cat?", ("Olive",)),
         Probe("On which floor is the new flat?", ("fourth", "4th", "4")),),
    ),
    _session(
        "clock_history",
        "Tell me the story of how people measured time before mechanical clocks: sundials, water clocks and "
        "candles. Keep it to a few paragraphs.",
        220,
        (("Why were pendulum clocks so much more accurate?", 160),
         ("Explain what a leap second is and why it exists.", 140)),
        (),
    ),
    _session(
        "fable",
        "Here is a fable. A crow named Tavi found a silver thimble on the riverbank and hid it in the hollow of an "
        "ash tree. A fox saw her and said that the thimble was cursed and would bring storms. Tavi did not "
        "believe the fox, but that night it thundered, and she gave the thimble away to the fox at dawn. The next "
        "day the sky was clear, and the fox wore the thimble as a hat.\n\nWhat is the moral of this fable?",
        160,
        (("Rewrite the fable so that the crow outwits the fox.", 220),
         ("Write a title for each version.", 60)),
        (Probe("In the fable at the start, where did the crow hide the thimble?", ("ash", "hollow")),
         Probe("In the fable at the start, what was the crow's name?", ("Tavi",))),
    ),
    _session(
        "paint_room",
        "I want to paint my bedroom. The walls are 2.5 metres high; the room is 4 metres by 3.5 metres, with one "
        "door of 2 square metres and a window of 1.5 square metres. One litre of paint covers 10 square metres, "
        "and I want two coats. How many litres do I need? Work it out step by step.",
        240,
        (("Paint comes in 2.5 litre tins at 24 dollars each. How much will I spend?", 140),
         ("Any tips for painting neat edges near the ceiling?", 140)),
        (Probe("How high are the walls of my bedroom?", ("2.5",)),),
    ),
    _session(
        "chess_club",
        "I run a chess club for children aged 8 to 12. We meet on Wednesdays in room B7 of the community centre, "
        "and we have 14 members and 6 boards. Suggest a plan for a 90-minute session so that nobody waits too "
        "long for a game.",
        220,
        (("Explain the rule of en passant simply enough for an eight-year-old.", 160),
         ("Write a short announcement for parents about a tournament next month.", 160)),
        (Probe("In which room does my chess club meet?", ("B7",)),
         Probe("How many boards does the club have?", ("6", "six"))),
    ),
    _session(
        "rain_poems",
        "Write a short poem about rain on a tin roof, in four stanzas, without using the word 'drop'.",
        160,
        (("Now write one about a dry summer field, in the same form.", 160),
         ("Which of the two poems uses more images of sound? Explain briefly.", 140)),
        (),
    ),
)

SESSIONS = (STORY, ARITHMETIC) + MORE
