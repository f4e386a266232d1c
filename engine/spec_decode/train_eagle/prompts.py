"""Deterministic, seeded instructions for self-distillation: templates x slots (topics, tasks,
audiences, forms, ...). No network. ``make_prompts(n, seed)`` returns n distinct user messages.

The held-out chat prompts (``benchmarks/data/chat_heldout.jsonl``) are hand-written and do not
come from these templates.
"""

from __future__ import annotations

import random

# fmt: off
TOPICS = (
    "photosynthesis", "black holes", "the water cycle", "volcanoes", "earthquakes", "tides",
    "the immune system", "vaccines", "DNA", "evolution", "climate change", "renewable energy",
    "solar panels", "wind turbines", "nuclear power", "electric cars", "batteries", "magnets",
    "gravity", "the speed of light", "the moon", "Mars", "the solar system", "comets",
    "the Roman Empire", "ancient Egypt", "the printing press", "the Industrial Revolution",
    "the French Revolution", "the Silk Road", "the Renaissance", "the Cold War", "the internet",
    "smartphones", "artificial intelligence", "machine learning", "computer viruses", "passwords",
    "cloud computing", "databases", "operating systems", "open source software", "blockchain",
    "3D printing", "robots", "drones", "satellites", "GPS", "bees", "ants", "dolphins",
    "elephants", "owls", "sharks", "coral reefs", "rainforests", "deserts", "glaciers", "rivers",
    "soil", "composting", "recycling", "plastic pollution", "air quality", "sleep", "dreams",
    "memory", "stress", "meditation", "nutrition", "vitamins", "coffee", "tea", "chocolate",
    "bread baking", "fermentation", "spices", "vegetarian cooking", "gardening", "houseplants",
    "birdwatching", "hiking", "camping", "cycling", "swimming", "chess", "football", "basketball",
    "the Olympic Games", "music theory", "jazz", "the piano", "the guitar", "painting",
    "photography", "film making", "poetry", "public speaking", "job interviews", "budgeting",
    "saving money", "inflation", "interest rates", "taxes", "small businesses", "marketing",
    "customer service", "teamwork", "leadership", "time management", "procrastination", "habits",
    "friendship", "kindness", "libraries", "museums", "trains", "airplanes", "bridges",
    "skyscrapers", "roads", "cities", "villages", "the ocean", "clouds", "rain", "snow",
    "thunderstorms", "rainbows", "the seasons", "maps", "languages", "writing systems", "numbers",
    "fractions", "prime numbers", "probability", "statistics", "geometry", "algebra",
    "the history of math", "electricity", "light bulbs", "telephones", "radio", "television",
    "newspapers", "democracy", "elections", "human rights", "volunteering", "charity", "pets",
    "dogs", "cats", "horses", "farming", "fishing", "forests", "mountains", "islands",
    "the Arctic", "penguins", "whales", "butterflies", "spiders", "mushrooms", "trees", "flowers",
)
ACTIVITIES = (
    "learning a new language", "running a first marathon", "starting a vegetable garden",
    "studying for exams", "working from home", "moving to a new city", "learning to cook",
    "saving for a holiday", "getting better sleep", "reading more books", "learning to code",
    "keeping a journal", "planning a wedding", "training a puppy", "staying focused",
    "making new friends", "preparing for a job interview", "writing a novel", "learning to swim",
    "organising a small kitchen", "travelling on a budget", "giving a presentation",
    "starting a podcast", "reducing screen time", "drinking more water", "learning the guitar",
    "taking better photos", "cleaning a messy room", "eating healthier",
    "starting a small business", "teaching a child to read", "running an online meeting",
    "hosting a dinner party", "decluttering a wardrobe", "learning to draw",
)
AUDIENCES = (
    "a five-year-old", "a ten-year-old", "a high school student", "a complete beginner",
    "a busy parent", "a retired teacher", "a university student", "a tourist",
    "someone who has never heard of it", "a software engineer", "a farmer", "an artist",
)
FORMS = (
    "a short poem", "a haiku", "a limerick", "a short story", "a diary entry", "a short speech",
    "a song chorus", "a riddle", "a fable with a moral", "a news report", "a product description",
    "a dialogue between two friends", "a motivational message", "a fairy tale opening",
    "a travel blog paragraph", "a letter to a friend",
)
CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "returns the factorial of n",
    "counts the vowels in a string", "finds the largest number in a list",
    "removes duplicates from a list while keeping the order",
    "checks whether a word is a palindrome", "returns the n-th Fibonacci number",
    "sorts a list of names alphabetically", "converts Celsius to Fahrenheit",
    "merges two sorted lists", "counts words in a sentence",
    "computes the average of a list of numbers", "returns the sum of the digits of a number",
    "checks whether two strings are anagrams", "flattens a nested list",
    "finds the second largest element of a list", "converts a binary string to an integer",
    "capitalises the first letter of every word",
    "returns the greatest common divisor of two numbers",
    "reads a text file and counts its lines", "filters the even numbers out of a list",
    "implements binary search", "checks whether brackets in a string are balanced",
)
LANGUAGES = (
    "Python", "Python", "Python", "JavaScript", "C", "Java", "Rust", "Go",
)
PAIRS = (
    ("cats", "dogs"), ("tea", "coffee"), ("trains", "planes"), ("books", "films"),
    ("summer", "winter"), ("cities", "the countryside"), ("renting", "buying a home"),
    ("Python", "JavaScript"), ("running", "swimming"), ("solar power", "wind power"),
    ("a laptop", "a tablet"), ("email", "phone calls"), ("classical music", "rock music"),
    ("the sun", "the moon"), ("weather", "climate"), ("a virus", "a bacterium"),
    ("a lake", "a sea"), ("frogs", "toads"), ("baking", "frying"), ("paper books", "e-books"),
    ("public transport", "driving"), ("saving", "investing"), ("mountains", "beaches"),
)
PEOPLE = (
    "my manager", "a neighbour", "my landlord", "a teacher", "a colleague", "my best friend",
    "a customer", "my grandmother", "a hotel", "the city council", "a new team member",
)
REQUESTS = (
    "asking for a day off next Friday", "thanking them for their help last week",
    "apologising for missing a meeting", "asking to reschedule our appointment",
    "inviting them to a birthday party", "complaining politely about noise at night",
    "asking for feedback on my work", "introducing myself",
    "requesting a refund for a late order", "asking for a recommendation letter",
    "congratulating them on a new job",
)
STYLES = (
    "", "", "", "", " Keep it short.", " Use simple words.", " Answer in three sentences.",
    " Use a numbered list.", " Be friendly and encouraging.", " Give one concrete example.",
    " Answer in one paragraph.", " Use bullet points.",
)
TEMPLATES = (
    ("Explain {topic} in simple terms.", 3), ("What is {topic}?", 3),
    ("How does {topic} work?", 2), ("Why is {topic} important?", 2),
    ("Explain {topic} to {audience}.", 3), ("Give me three interesting facts about {topic}.", 2),
    ("What are the main advantages and disadvantages of {topic}?", 1),
    ("Write a short paragraph about {topic}.", 2),
    ("Summarise the history of {topic} in a few sentences.", 1),
    ("What are common misconceptions about {topic}?", 1), ("Write {form} about {topic}.", 4),
    ("Give me {n} tips for {activity}.", 3), ("What are the first steps for {activity}?", 2),
    ("I want to get better at {activity}. Where should I start?", 2),
    ("Make a simple one-week plan for {activity}.", 1),
    ("What mistakes do people make when {activity}?", 1),
    ("Write a {lang} function that {code}.", 4),
    ("How would you write a program that {code}? Explain the idea, then show the code.", 1),
    ("Compare {a} and {b}.", 2), ("What is the difference between {a} and {b}?", 2),
    ("Which is better, {a} or {b}? Give reasons for both sides.", 1),
    ("Write an email to {person} {request}.", 3),
    ("Write a short message to {person} {request}.", 1),
    ("A shop sells pencils for {x} cents each. How much do {y} pencils cost? Show your work.", 1),
    ("What is {x} times {y}? Explain the steps.", 1),
    ("If a train travels {x} kilometres in {y} hours, what is its average speed?", 1),
    ("I have {x} apples and give away {y}. How many are left, and how did you work it out?", 1),
    ("Write a quiz with three questions about {topic}, with answers.", 1),
    ("List five words related to {topic} and explain each one briefly.", 1),
    ("Describe a day in the life of someone who works with {topic}.", 1),
    ("Tell me a fun story for children about {topic}.", 2),
    ("Write a title and a short introduction for a blog post about {topic}.", 1),
    ("What questions should I ask to learn more about {topic}?", 1),
)
# fmt: on


def _fill(template: str, rng: random.Random) -> str:
    a, b = rng.choice(PAIRS)
    x, y = rng.randint(2, 60), rng.randint(2, 12)
    return template.format(
        topic=rng.choice(TOPICS), audience=rng.choice(AUDIENCES), form=rng.choice(FORMS),
        activity=rng.choice(ACTIVITIES), n=rng.choice(("three", "four", "five")),
        lang=rng.choice(LANGUAGES), code=rng.choice(CODE_TASKS), a=a, b=b,
        person=rng.choice(PEOPLE), request=rng.choice(REQUESTS), x=max(x, y + 1), y=y,
    )  # fmt: skip


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct instructions, the same for the same (n, seed); the first k of n are the
    same for any larger n with the same seed."""
    rng = random.Random(seed)
    templates = [t for t, _ in TEMPLATES]
    weights = [w for _, w in TEMPLATES]
    seen: set[str] = set()
    out: list[str] = []
    for _ in range(100 * n + 1000):
        if len(out) == n:
            return out
        text = _fill(rng.choices(templates, weights)[0], rng) + rng.choice(STYLES)
        if text not in seen:
            seen.add(text)
            out.append(text)
    raise ValueError(f"could not make {n} distinct prompts")
