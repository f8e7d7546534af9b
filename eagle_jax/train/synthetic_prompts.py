"""Chat prompts built from instruction templates and topics, for regenerating draft
training data without downloading a dataset.

EAGLE-3 trains on the target's own responses to chat prompts (the responses matter, not
the prompts' provenance), so a varied, deterministic prompt set stands in for ShareGPT /
UltraChat where nothing can be downloaded. ``split="train"`` and ``split="eval"`` use
disjoint topic sets, so acceptance measured on ``eval`` is on prompts the draft never saw.
"""

from __future__ import annotations

import random

from eagle_jax.validate import one_of

TEMPLATES = [
    "Explain {t} to a ten-year-old.",
    "What is {t}? Answer in a short paragraph.",
    "Give me three interesting facts about {t}.",
    "Write a short story that involves {t}.",
    "Write a poem about {t}.",
    "What are the pros and cons of {t}?",
    "How would you describe {t} to someone who has never heard of it?",
    "List five questions a student might ask about {t}, with brief answers.",
    "Summarize the history of {t} in a few sentences.",
    "Why do people care about {t}?",
    "Write a product description for something related to {t}.",
    "Give me a step-by-step guide to getting started with {t}.",
    "What are common misconceptions about {t}?",
    "Compare {t} with something similar and explain the differences.",
    "Write a short dialogue between two friends discussing {t}.",
    "What would the world look like without {t}?",
    "Write an email to a colleague recommending that they learn about {t}.",
    "Describe {t} in exactly three sentences.",
    "What are the most important things to know about {t}?",
    "Create a quiz with three multiple-choice questions about {t}.",
    "Write a motivational message inspired by {t}.",
    "Explain how {t} works.",
    "Give advice to a beginner interested in {t}.",
    "Write a limerick about {t}.",
    "What careers are related to {t}?",
    "Tell me a fun fact about {t} and explain why it is true.",
    "Write a short news headline and article about {t}.",
    "How has {t} changed over the last hundred years?",
    "What are some good books or resources for learning about {t}?",
    "Describe a typical day for someone who works with {t}.",
    "Write a tweet about {t}.",
    "Explain {t} using an analogy.",
    "What are the environmental effects of {t}?",
    "Write a recipe-style set of instructions for enjoying {t}.",
    "Argue for and against the importance of {t}.",
    "Outline a short presentation about {t}.",
]

_TOPICS = """
photosynthesis; volcanoes; the moon landing; black holes; honeybees; the Roman Empire;
machine learning; coffee; the water cycle; electric cars; the Great Wall of China;
chess; jazz music; the human heart; recycling; dinosaurs; the internet; gardening;
solar panels; the Olympic Games; penguins; earthquakes; vaccines; the printing press;
rainforests; cryptocurrency; yoga; the stock market; origami; Mount Everest; sharks;
democracy; the periodic table; tea ceremonies; bicycles; the French Revolution;
climate change; robots; the Amazon river; meditation; pizza; the piano; glaciers;
social media; the Renaissance; octopuses; airplanes; public libraries; birdwatching;
nuclear energy; the Eiffel Tower; sleep; chocolate; the immune system; video games;
ancient Egypt; rainbows; hiking; the theory of evolution; wind turbines; cats; dogs;
the Silk Road; computer programming; soccer; the ocean tides; tornadoes; bread baking;
the Milky Way; microscopes; public transportation; the Industrial Revolution; elephants;
deserts; smartphones; painting with watercolors; the Moon; friendship; time management;
photography; the Arctic; coral reefs; the Beatles; space stations; learning a language;
mushrooms; bridges; the speed of light; writing a resume; saving money; trains;
the brain; skyscrapers; camping; the Pyramids; butterflies; running a marathon;
renewable energy; cheese making; the Vikings; quantum computers; thunderstorms; museums;
wolves; the human genome; knitting; mathematics; the Sahara; volunteering; castles;
submarines; the violin; basketball; urban gardens; satellites; ancient Greece; owls
"""

_EVAL_TOPICS = """
lighthouses; hot air balloons; the Mariana Trench; jellyfish; typewriters; the Aztecs;
kites; maple syrup; northern lights; sign language; beekeeping in cities; canals;
fireflies; the metric system; board games; sourdough; compasses; hummingbirds
"""

CODE_TASKS = [
    "Write a Python function that {c}.",
    "Show how to {c} in JavaScript.",
    "Explain, with a short Python example, how to {c}.",
]

_CODE = """
checks whether a number is prime; counts the vowels in a string; merges two sorted lists;
computes the factorial of a number; finds the largest element in a list;
removes duplicates from a list; converts Celsius to Fahrenheit; reads a text file line by line;
computes the Fibonacci sequence; sorts a list of dictionaries by a key;
checks whether a word is a palindrome; flattens a nested list; counts word frequencies in a text;
computes the average of a list of numbers; validates an email address with a regular expression
"""

_EVAL_CODE = """
finds the second smallest number in a list; capitalizes every word in a sentence;
computes the greatest common divisor of two numbers
"""


def _split(s: str) -> list[str]:
    return [t.strip() for t in s.replace("\n", " ").split(";") if t.strip()]


def synthetic_prompts(n: int, *, split: str = "train", seed: int = 0) -> list[str]:
    """``n`` distinct user prompts (fewer if the split has fewer combinations).

    Deterministic for a given (n, split, seed). ``split`` is "train" or "eval"; the two
    share templates but not topics.
    """
    one_of("split", split, ("train", "eval"), error=ValueError)
    topics = _split(_TOPICS if split == "train" else _EVAL_TOPICS)
    code = _split(_CODE if split == "train" else _EVAL_CODE)
    pool = [tpl.format(t=t) for tpl in TEMPLATES for t in topics]
    pool += [tpl.format(c=c) for tpl in CODE_TASKS for c in code]
    random.Random(seed).shuffle(pool)
    return pool[:n]
