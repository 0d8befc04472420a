"""The chat domain of the demo corpus: dialogues rendered with the chat template
(``demo.tokenizer.render_chat``): Q/A built from docstrings and sources of stdlib
functions and classes (held-out files give the held-out dialogues), arithmetic and word
problems, small coding tasks, small talk. For coding tasks one (task, phrasing) pair per
task is reserved for held-out. Most of this module is the data the dialogues are drawn from."""

from __future__ import annotations

import random

from demo.corpus_code import Definition
from demo.corpus_math import math_problem, operand, word_problem
from demo.tokenizer import render_chat

_SYSTEMS = [
    None,
    None,
    None,
    "You are a helpful assistant.",
    "You are a Python expert.",
    "You are a patient math tutor.",
    "You are a concise assistant. Answer briefly.",
]


def _docstring_dialogue(rng: random.Random, d: Definition) -> list[dict]:
    full = f"{d.module}.{d.qualname}"
    kind = d.kind
    choice = rng.random()
    if d.source and choice < 0.25:
        q = rng.choice(
            [
                f"Show me the implementation of {full}.",
                f"How is `{full}` implemented?",
                f"Can you show the source code of {full}?",
            ]
        )
        a = f"Here is the source of `{d.qualname}` from the `{d.module}` module:\n\n```python\n{d.source}\n```"
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    if kind != "class" and choice < 0.4:
        q = rng.choice([f"What arguments does {full} take?", f"What is the signature of `{full}`?"])
        a = f"`{d.qualname}` is defined in `{d.module}` as:\n\n```python\ndef {d.name}({d.args}):\n```\n\n{d.doc}"
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    q = rng.choice(
        [
            f"What does `{full}` do?",
            f"What does {full} do?",
            f"Explain the {kind} {d.qualname} in the {d.module} module.",
            f"Can you describe {full}?",
            f"What is `{d.qualname}` used for in {d.module}?",
            f"I found `{full}` in the standard library. What is it for?",
        ]
    )
    sig = f"{d.qualname}({d.args})"
    a = rng.choice(
        [
            f"`{d.module}.{sig}`: {d.doc}",
            f"In the `{d.module}` module, `{d.qualname}` is a {kind}. {d.doc}",
            f"The {kind} `{sig}` from `{d.module}`. Its documentation says: {d.doc}",
        ]
    )
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


_OPS = {
    "+": ("plus", lambda a, b: a + b),
    "-": ("minus", lambda a, b: a - b),
    "*": ("times", lambda a, b: a * b),
}


def _arith_dialogue(rng: random.Random) -> list[dict]:
    op = rng.choice(["+", "-", "*"])
    if op == "*":
        a, b = rng.randint(2, 30), rng.randint(2, 12)
    else:
        a, b = operand(rng), operand(rng)
        if op == "-":
            a, b = max(a, b), min(a, b)
    word, f = _OPS[op]
    c = f(a, b)
    q = rng.choice(
        [
            f"What is {a} {op} {b}?",
            f"Can you compute {a} {op} {b}?",
            f"Please calculate {a} {op} {b}.",
            f"How much is {a} {word} {b}?",
            f"{a} {op} {b} = ?",
        ]
    )
    ans = rng.choice(
        [
            f"{a} {op} {b} = {c}.",
            f"Sure! {a} {op} {b} = {c}.",
            f"The result is {c}, since {a} {op} {b} = {c}.",
        ]
    )
    msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]
    if rng.random() < 0.35:
        op2 = rng.choice(["+", "*"])
        d = rng.randint(2, 20) if op2 == "+" else rng.randint(2, 5)
        f2 = _OPS[op2][1]
        e = f2(c, d)
        if op2 == "+":
            q2 = rng.choice([f"Now add {d} to that.", f"And if we add {d}?"])
        else:
            q2 = rng.choice([f"Now multiply that by {d}.", f"And if we multiply by {d}?"])
        msgs += [
            {"role": "user", "content": q2},
            {"role": "assistant", "content": f"{c} {op2} {d} = {e}."},
        ]
    return msgs


def _word_dialogue(rng: random.Random) -> list[dict]:
    q, a = math_problem(rng) if rng.random() < 0.3 else word_problem(rng)
    if rng.random() < 0.3:
        q = (
            rng.choice(["Can you help me with this problem? ", "Please solve: ", "Math question: "])
            + q
        )
    a = rng.choice(["", "Let's work it out step by step. ", "Step by step: "]) + a
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


# (description as "a function that ...", infinitive "to ...", function name, code, note)
_CODE_TASKS = [
    (
        "returns the sum of a list of numbers",
        "add up the numbers in a list",
        "total",
        "def total(numbers):\n    result = 0\n    for x in numbers:\n        result += x\n    return result",
        "The built-in `sum(numbers)` does the same thing.",
    ),
    (
        "returns the largest number in a list",
        "find the maximum of a list",
        "largest",
        "def largest(numbers):\n    best = numbers[0]\n    for x in numbers[1:]:\n"
        "        if x > best:\n            best = x\n    return best",
        "The built-in `max(numbers)` does the same thing.",
    ),
    (
        "returns the smallest number in a list",
        "find the minimum of a list",
        "smallest",
        "def smallest(numbers):\n    best = numbers[0]\n    for x in numbers[1:]:\n"
        "        if x < best:\n            best = x\n    return best",
        "The built-in `min(numbers)` does the same thing.",
    ),
    (
        "checks whether a number is even",
        "check if a number is even",
        "is_even",
        "def is_even(n):\n    return n % 2 == 0",
        "A number is even when the remainder of division by 2 is zero.",
    ),
    (
        "checks whether a number is prime",
        "test if a number is prime",
        "is_prime",
        "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n"
        "        if n % i == 0:\n            return False\n        i += 1\n    return True",
        "It only tries divisors up to the square root of `n`.",
    ),
    (
        "reverses a string",
        "reverse a string",
        "reverse",
        "def reverse(text):\n    return text[::-1]",
        "The slice `[::-1]` walks the string backwards.",
    ),
    (
        "checks whether a string is a palindrome",
        "check if a string is a palindrome",
        "is_palindrome",
        "def is_palindrome(text):\n    text = text.lower()\n    return text == text[::-1]",
        "A palindrome reads the same forwards and backwards.",
    ),
    (
        "counts the vowels in a string",
        "count the vowels in a string",
        "count_vowels",
        'def count_vowels(text):\n    return sum(1 for ch in text.lower() if ch in "aeiou")',
        "It checks each character against the string of vowels.",
    ),
    (
        "computes the factorial of n",
        "compute a factorial",
        "factorial",
        "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result",
        "`math.factorial(n)` from the standard library does the same thing.",
    ),
    (
        "returns the n-th Fibonacci number",
        "compute Fibonacci numbers",
        "fibonacci",
        "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
        "It keeps the last two numbers of the sequence.",
    ),
    (
        "converts Celsius to Fahrenheit",
        "convert Celsius to Fahrenheit",
        "celsius_to_fahrenheit",
        "def celsius_to_fahrenheit(celsius):\n    return celsius * 9 / 5 + 32",
        "For example, 100 degrees Celsius is 212 degrees Fahrenheit.",
    ),
    (
        "removes duplicates from a list while keeping the order",
        "remove duplicates from a list",
        "unique",
        "def unique(items):\n    seen = set()\n    result = []\n    for item in items:\n"
        "        if item not in seen:\n            seen.add(item)\n"
        "            result.append(item)\n    return result",
        "The set makes each membership test fast.",
    ),
    (
        "counts how often each word appears in a text",
        "count words in a text",
        "word_counts",
        "def word_counts(text):\n    counts = {}\n    for word in text.split():\n"
        "        counts[word] = counts.get(word, 0) + 1\n    return counts",
        "`collections.Counter(text.split())` does the same thing.",
    ),
    (
        "flattens a list of lists",
        "flatten a nested list",
        "flatten",
        "def flatten(lists):\n    result = []\n    for inner in lists:\n"
        "        result.extend(inner)\n    return result",
        "It extends the result with each inner list.",
    ),
    (
        "returns the average of a list of numbers",
        "compute the mean of a list",
        "average",
        'def average(numbers):\n    if not numbers:\n        raise ValueError("empty list")\n'
        "    return sum(numbers) / len(numbers)",
        "`statistics.mean(numbers)` does the same thing.",
    ),
    (
        "reads a text file and returns its lines",
        "read the lines of a file",
        "read_lines",
        'def read_lines(path):\n    with open(path, encoding="utf-8") as f:\n        return f.read().splitlines()',
        "The `with` statement closes the file when the block ends.",
    ),
    (
        "merges two dictionaries",
        "merge two dictionaries",
        "merge",
        "def merge(a, b):\n    result = dict(a)\n    result.update(b)\n    return result",
        "Keys from `b` win when both dictionaries have them.",
    ),
    (
        "squares every number in a list",
        "square each element of a list",
        "squares",
        "def squares(numbers):\n    return [x * x for x in numbers]",
        "A list comprehension builds the new list.",
    ),
    (
        "returns the even numbers of a list",
        "keep only the even numbers",
        "evens",
        "def evens(numbers):\n    return [x for x in numbers if x % 2 == 0]",
        "The condition filters the list.",
    ),
    (
        "computes the greatest common divisor of two numbers",
        "compute a greatest common divisor",
        "gcd",
        "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a",
        "This is Euclid's algorithm; `math.gcd` does the same thing.",
    ),
    (
        "counts the lines in a file",
        "count lines in a file",
        "count_lines",
        'def count_lines(path):\n    with open(path, encoding="utf-8") as f:\n        return sum(1 for _ in f)',
        "Iterating over a file yields one line at a time.",
    ),
    (
        "capitalizes every word in a sentence",
        "capitalize each word",
        "title_case",
        'def title_case(sentence):\n    return " ".join(word.capitalize() for word in sentence.split())',
        "`str.title()` is similar but treats apostrophes differently.",
    ),
    (
        "sorts a list of words by length",
        "sort words by their length",
        "sort_by_length",
        "def sort_by_length(words):\n    return sorted(words, key=len)",
        "The `key` argument tells `sorted` what to compare.",
    ),
    (
        "returns the last n items of a list",
        "get the last n elements of a list",
        "last_items",
        "def last_items(items, n):\n    if n <= 0:\n        return []\n    return items[-n:]",
        "Negative slice indices count from the end.",
    ),
]


_CODE_PATTERNS = [
    "Write a Python function that {desc}.",
    "How do I {inf} in Python?",
    "Can you write code to {inf}?",
    "Show me a function that {desc}.",
    "I need a Python function that {desc}. Can you help?",
]


def _code_dialogue(task: tuple, pattern: str, rng: random.Random) -> list[dict]:
    desc, inf, name, code, note = task
    q = pattern.format(desc=desc, inf=inf)
    intro = rng.choice(
        [
            f"Here is a function that {desc}:",
            "Sure, here is one way to do it:",
            f"You can use a function like `{name}`:",
        ]
    )
    a = f"{intro}\n\n```python\n{code}\n```\n\n{note}"
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


_SMALLTALK = [
    (
        ["Hello!", "Hi!", "Hi there.", "Hello, how are you?", "Good morning!", "Hey!"],
        [
            "Hello! How can I help you today?",
            "Hi! What can I do for you?",
            "Hello! I can help with Python code and arithmetic.",
        ],
    ),
    (
        ["Who are you?", "What are you?", "What is your name?", "Tell me about yourself."],
        [
            "I am a small language model trained for the FlashMap Serve demo. I can talk about "
            "Python code and arithmetic.",
            "I am a tiny demo assistant. I was trained on Python source code, math problems and short dialogues.",
        ],
    ),
    (
        ["What can you do?", "How can you help me?", "What are you good at?"],
        [
            "I can explain functions from the Python standard library, write small Python "
            "functions, and solve arithmetic and word problems step by step."
        ],
    ),
    (
        ["Thank you!", "Thanks.", "Thanks a lot!", "Great, thank you."],
        [
            "You're welcome!",
            "Glad I could help!",
            "You're welcome. Let me know if you have another question.",
        ],
    ),
    (["Bye!", "Goodbye.", "See you later."], ["Goodbye!", "Bye! Have a nice day."]),
]


def _smalltalk_dialogue(rng: random.Random) -> list[dict]:
    qs, answers = rng.choice(_SMALLTALK)
    return [
        {"role": "user", "content": rng.choice(qs)},
        {"role": "assistant", "content": rng.choice(answers)},
    ]


def _with_system(rng: random.Random, msgs: list[dict]) -> list[dict]:
    sysmsg = rng.choice(_SYSTEMS)
    return ([{"role": "system", "content": sysmsg}] if sysmsg else []) + msgs


def _chat_prompt(msgs: list[dict]) -> tuple[str, str]:
    """Prompt = everything up to the last assistant turn + generation prompt; reference = that turn."""
    assert msgs[-1]["role"] == "assistant"
    return render_chat(msgs[:-1], add_generation_prompt=True), msgs[-1]["content"] + "<|im_end|>"


def build_chat(
    rng: random.Random,
    train_defs: list,
    held_defs: list,
    n_arith: int = 9_000,
    n_word: int = 7_000,
    n_code: int = 4_000,
    n_small: int = 1_200,
    n_prompts: int = 48,
) -> tuple[list[str], list[str], list[dict], list[dict]]:
    """(train documents, held-out documents, dev prompts, test prompts): per kind of dialogue
    the dev prompts come first, the test prompts (as many) next."""
    # Reserve one phrasing per coding task for held-out.
    reserved = {i: rng.randrange(len(_CODE_PATTERNS)) for i in range(len(_CODE_TASKS))}
    dialogues: list[list[dict]] = []
    for d in train_defs:
        dialogues.append(_docstring_dialogue(rng, d))
    for _ in range(n_arith):
        dialogues.append(_arith_dialogue(rng))
    for _ in range(n_word):
        dialogues.append(_word_dialogue(rng))
    for _ in range(n_code):
        ti = rng.randrange(len(_CODE_TASKS))
        pi = rng.choice([p for p in range(len(_CODE_PATTERNS)) if p != reserved[ti]])
        dialogues.append(_code_dialogue(_CODE_TASKS[ti], _CODE_PATTERNS[pi], rng))
    for _ in range(n_small):
        dialogues.append(_smalltalk_dialogue(rng))
    rng.shuffle(dialogues)
    train = [render_chat(_with_system(rng, m)) for m in dialogues]
    train_set = set(train)

    # Held-out: docstrings of held-out files, fresh arithmetic / word problems, reserved
    # coding phrasings, small talk (the small-talk bank is shared with training).
    held_rng = random.Random(rng.random())
    held: list[tuple[str, list[dict]]] = []
    defs = list(held_defs)
    held_rng.shuffle(defs)
    held += [("docstring", _docstring_dialogue(held_rng, d)) for d in defs[:600]]
    held += [("arith", _arith_dialogue(held_rng)) for _ in range(300)]
    held += [("word", _word_dialogue(held_rng)) for _ in range(300)]
    held += [
        ("code_task", _code_dialogue(_CODE_TASKS[i], _CODE_PATTERNS[reserved[i]], held_rng))
        for i in range(len(_CODE_TASKS))
    ]
    held += [("smalltalk", _smalltalk_dialogue(held_rng)) for _ in range(20)]
    held = [(k, _with_system(held_rng, m)) for k, m in held]
    held = [(k, m) for k, m in held if render_chat(m) not in train_set]
    heldout = [render_chat(m) for _, m in held]
    # Prompts: a fixed mix of kinds, each in seeded order.
    quota = {"docstring": 16, "arith": 8, "word": 10, "code_task": 10, "smalltalk": 4}
    scale = n_prompts / sum(quota.values())
    picked: list[tuple[str, list[dict]]] = []
    later: list[tuple[str, list[dict]]] = []
    for kind, k in quota.items():
        items = [x for x in held if x[0] == kind]
        n = max(1, round(k * scale))
        picked += items[:n]
        later += items[n : 2 * n]
    splits = []
    for tag, part in (("chat", picked), ("chat-test", later)):
        splits.append(
            [
                {
                    "domain": "chat",
                    "id": f"{tag}-{j:03d}",
                    "kind": kind,
                    "prompt": p,
                    "reference": r,
                }
                for j, (kind, m) in enumerate(part)
                for p, r in [_chat_prompt(m)]
            ]
        )
    return train, heldout, splits[0], splits[1]
