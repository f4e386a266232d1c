"""Deterministic, seeded instructions for self-distillation: templates x slots (topics, tasks,
audiences, forms, ...). No network. ``make_prompts(n, seed)`` returns n distinct user messages:
the first ``BASE_ONLY`` from the base templates (the set the first shipped head was trained on, so
its cached answers stay valid), then alternately from the everyday-chat templates (advice, why-
questions, recipes, short writing for a person) and the base templates.

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
CHAT_THINGS = (
    "my laptop", "my bike", "a wooden table", "white sneakers", "a coffee machine", "my phone",
    "a wool sweater", "a kitchen sink", "a leather bag", "the oven", "a fish tank", "my car",
    "a garden hose", "a bathroom mirror", "a frying pan", "a washing machine", "my headphones",
)
CHAT_PROBLEMS = (
    "keeps making a strange noise", "smells bad", "stopped working this morning",
    "has a stain I cannot remove", "is much slower than it used to be", "keeps getting dusty",
    "has a small crack", "gets very hot", "is too loud at night",
)
CHAT_SITUATIONS = (
    "my neighbour plays loud music late at night", "I cannot fall asleep before 2 am",
    "my friend always arrives late", "I forgot my best friend's birthday",
    "my roommate never does the dishes", "I have too many unread emails",
    "I get bored at work in the afternoon", "my dog barks at every visitor",
    "I feel lonely after moving to a new town", "my child does not want to eat vegetables",
    "I spend too much money on takeaway food", "I keep losing my keys",
    "my plants die after a few weeks", "I am nervous about my first day at a new job",
    "my team disagrees about a project plan", "I want to ask for a raise",
    "I have a long flight next week", "my houseguest is staying longer than planned",
)
CHAT_INGREDIENTS = (
    "eggs, tomatoes and cheese", "pasta, garlic and olive oil", "potatoes and onions",
    "rice, beans and peppers", "bread, milk and bananas", "lentils and carrots",
    "chicken and mushrooms", "oats, apples and cinnamon", "tofu, broccoli and soy sauce",
    "flour, butter and sugar", "salmon and lemon", "chickpeas and spinach",
)
CHAT_PHENOMENA = (
    "do leaves change colour in autumn", "does bread go stale", "does ice float on water",
    "do cats purr", "do we yawn", "is the sea salty", "does metal feel colder than wood",
    "do we get goosebumps", "does popcorn pop", "do stars twinkle", "are bubbles round",
    "do dogs wag their tails", "do we need to sleep", "does the moon look bigger near the horizon",
    "are some people left-handed", "does soap remove grease", "do old books smell the way they do",
    "do planes leave white trails in the sky", "does my voice sound different on recordings",
)
CHAT_PEOPLE = (
    "Leonardo da Vinci", "Ada Lovelace", "Isaac Newton", "Cleopatra", "Nelson Mandela",
    "Charles Darwin", "Frida Kahlo", "Albert Einstein", "Jane Austen", "Galileo Galilei",
    "Florence Nightingale", "Mozart", "Amelia Earhart", "Confucius", "Rosalind Franklin",
)
CHAT_OCCASIONS = (
    "a colleague who is retiring", "my parents' anniversary", "a friend who passed an exam",
    "a neighbour who helped me move", "a new baby in the family", "my team's first launch",
    "a teacher at the end of the school year", "a friend who is feeling sick",
    "a housewarming party", "my brother's graduation",
)
CHAT_CHARACTERS = (
    "a brave little mouse", "a robot who wants to paint", "a lost penguin", "a shy giant",
    "a talking teapot", "a lighthouse keeper", "a curious cloud", "an old pirate",
    "a detective cat", "a tree that can walk", "a girl who collects stars", "a tired postman",
)
CHAT_TEMPLATES = (
    ("{thing} {problem}. What should I do?", 3), ("How do I clean {thing}?", 1),
    ("{situation}. Any advice?", 4), ("{situation}. How should I handle it?", 2),
    ("I have {ingredients}. What can I make for dinner?", 2),
    ("Give me a simple recipe that uses {ingredients}.", 2),
    ("Why {phenomenon}?", 3), ("I have always wondered: why {phenomenon}?", 1),
    ("Tell me about the life of {famous}.", 2), ("What is {famous} best known for?", 1),
    ("Write a short card message for {occasion}.", 2),
    ("Help me write a few kind words for {occasion}.", 1),
    ("Write a short story about {character}.", 2),
    ("Write a poem about {character}.", 1), ("Tell me a joke about {topic}.", 1),
    ("What is a fun weekend activity related to {topic}?", 1),
    ("What should I know before {activity}?", 2), ("Is {activity} hard? Be honest.", 1),
    ("Suggest a name for a small shop that sells things related to {topic}.", 1),
    ("What would happen if there were no {topic}?", 1),
    ("Can you help me understand {topic}? I find it confusing.", 2),
    ("What are some good questions to ask {person}?", 1),
    ("My friend says {a} are better than {b}. What do you think?", 1),
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


def _fill_chat(template: str, rng: random.Random) -> str:
    a, b = rng.choice(PAIRS)
    text = template.format(
        thing=rng.choice(CHAT_THINGS), problem=rng.choice(CHAT_PROBLEMS),
        situation=rng.choice(CHAT_SITUATIONS), ingredients=rng.choice(CHAT_INGREDIENTS),
        phenomenon=rng.choice(CHAT_PHENOMENA), famous=rng.choice(CHAT_PEOPLE),
        occasion=rng.choice(CHAT_OCCASIONS), character=rng.choice(CHAT_CHARACTERS),
        topic=rng.choice(TOPICS), activity=rng.choice(ACTIVITIES), person=rng.choice(PEOPLE),
        a=a, b=b,
    )  # fmt: skip
    return text[0].upper() + text[1:]


def _stream(fill, templates: tuple, seed: int):
    """Endless seeded instructions from ``templates`` (weighted), each with a random style."""
    rng = random.Random(seed)
    texts = [t for t, _ in templates]
    weights = [w for _, w in templates]
    while True:
        yield fill(rng.choices(texts, weights)[0], rng) + rng.choice(STYLES)


# prompts 0..BASE_ONLY-1 come from the base templates alone (see the module docstring)
BASE_ONLY = 1600


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct instructions, the same for the same (n, seed); the first k of n are the
    same for any larger n with the same seed."""
    base = _stream(_fill, TEMPLATES, seed)
    chat = _stream(_fill_chat, CHAT_TEMPLATES, seed + 1_000_003)
    seen: set[str] = set()
    out: list[str] = []
    for _ in range(100 * n + 1000):
        if len(out) == n:
            return out
        use_chat = len(out) >= BASE_ONLY and (len(out) - BASE_ONLY) % 2 == 0
        text = next(chat if use_chat else base)
        if text not in seen:
            seen.add(text)
            out.append(text)
    raise ValueError(f"could not make {n} distinct prompts")
