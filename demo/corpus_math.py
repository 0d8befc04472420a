"""The math domain of the demo corpus: generated problems with worked solutions, formatted
as ``Question: ...\nAnswer: ...`` (arithmetic, order of operations, linear equations,
remainders, percentages and word problems). Held-out problems come from a different random
stream and never repeat a training question. The chat domain asks the same problems."""

from __future__ import annotations

import random

_NAMES = [
    ("Alice", "she", "her"),
    ("Bob", "he", "his"),
    ("Carol", "she", "her"),
    ("David", "he", "his"),
    ("Emma", "she", "her"),
    ("Frank", "he", "his"),
    ("Grace", "she", "her"),
    ("Henry", "he", "his"),
    ("Ivy", "she", "her"),
    ("Jack", "he", "his"),
    ("Kate", "she", "her"),
    ("Leo", "he", "his"),
    ("Mia", "she", "her"),
    ("Noah", "he", "his"),
    ("Olivia", "she", "her"),
    ("Paul", "he", "his"),
    ("Rosa", "she", "her"),
    ("Sam", "he", "his"),
    ("Tina", "she", "her"),
    ("Victor", "he", "his"),
]


_ITEMS = [
    "apples",
    "oranges",
    "pencils",
    "books",
    "marbles",
    "stickers",
    "cookies",
    "cards",
    "coins",
    "flowers",
    "eggs",
    "stamps",
    "shells",
    "candies",
    "balloons",
    "toy cars",
]


_THINGS = [
    ("notebook", "notebooks"),
    ("pen", "pens"),
    ("ticket", "tickets"),
    ("sandwich", "sandwiches"),
    ("bottle of water", "bottles of water"),
    ("book", "books"),
    ("ball", "balls"),
    ("cup of tea", "cups of tea"),
]


_CONTAINERS = ["boxes", "bags", "baskets", "jars", "shelves", "rows", "packs", "crates"]


def _n(rng: random.Random, lo: int, hi: int) -> int:
    return rng.randint(lo, hi)


def operand(rng: random.Random) -> int:
    """A number of 1 to 3 digits, mostly small."""
    r = rng.random()
    if r < 0.45:
        return _n(rng, 1, 20)
    if r < 0.85:
        return _n(rng, 10, 99)
    return _n(rng, 100, 999)


def _mul_steps(a: int, b: int) -> str:
    """Worked multiplication of a (2-3 digits) by b (1 digit)."""
    parts = []
    s = str(a)
    for i, ch in enumerate(s):
        place = 10 ** (len(s) - 1 - i)
        if ch != "0":
            parts.append(int(ch) * place)
    if len(parts) < 2:
        return f"{a} * {b} = {a * b}"
    terms = " + ".join(f"{p} * {b}" for p in parts)
    prods = " + ".join(str(p * b) for p in parts)
    return f"{a} * {b} = {terms} = {prods} = {a * b}"


def math_problem(rng: random.Random) -> tuple[str, str]:
    """One (question, worked answer) pair."""
    kind = rng.choices(
        ["add", "sub", "mul", "div", "paren", "prec", "eq", "rem", "pct", "cmp", "sq", "word"],
        weights=[10, 9, 10, 6, 6, 5, 6, 4, 3, 3, 3, 35],
    )[0]
    if kind == "add":
        a, b = operand(rng), operand(rng)
        q = rng.choice(
            [
                f"What is {a} + {b}?",
                f"Compute {a} + {b}.",
                f"What is the sum of {a} and {b}?",
                f"Add {a} and {b}.",
            ]
        )
        return q, f"{a} + {b} = {a + b}. The answer is {a + b}."
    if kind == "sub":
        a, b = operand(rng), operand(rng)
        a, b = max(a, b), min(a, b)
        q = rng.choice(
            [
                f"What is {a} - {b}?",
                f"Compute {a} - {b}.",
                f"Subtract {b} from {a}.",
                f"What is {a} minus {b}?",
            ]
        )
        return q, f"{a} - {b} = {a - b}. The answer is {a - b}."
    if kind == "mul":
        if rng.random() < 0.6:
            a, b = _n(rng, 2, 12), _n(rng, 2, 12)
            q = rng.choice(
                [
                    f"What is {a} * {b}?",
                    f"What is {a} times {b}?",
                    f"Compute {a} * {b}.",
                    f"Multiply {a} by {b}.",
                ]
            )
            return q, f"{a} * {b} = {a * b}. The answer is {a * b}."
        a, b = _n(rng, 11, 399), _n(rng, 2, 9)
        q = rng.choice([f"What is {a} * {b}?", f"Compute {a} * {b}.", f"Multiply {a} by {b}."])
        return q, f"{_mul_steps(a, b)}. The answer is {a * b}."
    if kind == "div":
        b, c = _n(rng, 2, 12), _n(rng, 2, 25)
        a = b * c
        q = rng.choice(
            [f"What is {a} / {b}?", f"Divide {a} by {b}.", f"What is {a} divided by {b}?"]
        )
        return q, f"{a} / {b} = {c}, because {b} * {c} = {a}. The answer is {c}."
    if kind == "paren":
        a, b, c = operand(rng) % 50 + 1, operand(rng) % 50 + 1, _n(rng, 2, 9)
        if rng.random() < 0.5:
            s = a + b
            return (
                f"Compute ({a} + {b}) * {c}.",
                f"First, {a} + {b} = {s}. Then, {s} * {c} = {s * c}. The answer is {s * c}.",
            )
        a, b = max(a, b), min(a, b)
        s = a - b
        return (
            f"Compute ({a} - {b}) * {c}.",
            f"First, {a} - {b} = {s}. Then, {s} * {c} = {s * c}. The answer is {s * c}.",
        )
    if kind == "prec":
        a, b, c = _n(rng, 1, 60), _n(rng, 2, 12), _n(rng, 2, 12)
        p = b * c
        return (
            f"What is {a} + {b} * {c}?",
            f"Multiplication comes first: {b} * {c} = {p}. Then, {a} + {p} = {a + p}. The answer is {a + p}.",
        )
    if kind == "eq":
        a, x, b = _n(rng, 2, 9), _n(rng, 1, 20), _n(rng, 1, 40)
        c = a * x + b
        return (
            f"Solve for x: {a}x + {b} = {c}.",
            f"Subtract {b} from both sides: {a}x = {c - b}. Divide both sides by {a}: x = {x}. The answer is x = {x}.",
        )
    if kind == "rem":
        b = _n(rng, 2, 12)
        a = _n(rng, b + 1, 150)
        qt, r = divmod(a, b)
        return (
            f"What is the remainder when {a} is divided by {b}?",
            f"{a} = {b} * {qt} + {r}, so the remainder is {r}. The answer is {r}.",
        )
    if kind == "pct":
        p = rng.choice([10, 20, 25, 50, 75])
        n = rng.choice([20, 40, 60, 80, 100, 120, 200, 240, 300, 400, 500, 800])
        r = n * p // 100
        return f"What is {p}% of {n}?", f"{p}% of {n} is {n} * {p} / 100 = {r}. The answer is {r}."
    if kind == "cmp":
        a, b = operand(rng), operand(rng)
        while b == a:
            b = operand(rng)
        big = max(a, b)
        return (
            f"Which is larger, {a} or {b}?",
            f"{big} is larger, because {big} - {min(a, b)} = {big - min(a, b)} is positive. The answer is {big}.",
        )
    if kind == "sq":
        a = _n(rng, 2, 25)
        return (
            f"What is the square of {a}?",
            f"The square of {a} is {a} * {a} = {a * a}. The answer is {a * a}.",
        )
    return word_problem(rng)


def word_problem(rng: random.Random) -> tuple[str, str]:
    name, he, his = rng.choice(_NAMES)
    friend = rng.choice([n for n in _NAMES if n[0] != name])[0]
    item = rng.choice(_ITEMS)
    He = he.capitalize()
    kind = rng.randrange(10)
    if kind == 0:
        a, b = _n(rng, 2, 60), _n(rng, 2, 40)
        return (
            f"{name} has {a} {item}. {He} buys {b} more. How many {item} does {he} have now?",
            f"{name} starts with {a} {item} and buys {b} more, so {he} has {a} + {b} = {a + b} "
            f"{item}. The answer is {a + b}.",
        )
    if kind == 1:
        a = _n(rng, 10, 90)
        b = _n(rng, 1, a - 1)
        return (
            f"{name} has {a} {item} and gives {b} of them to {friend}. How many {item} does {name} have left?",
            f"{name} gives away {b} of {his} {a} {item}, so {a} - {b} = {a - b} {item} are left. "
            f"The answer is {a - b}.",
        )
    if kind == 2:
        a, b = _n(rng, 2, 12), _n(rng, 2, 15)
        box = rng.choice(_CONTAINERS)
        return (
            f"There are {a} {box} with {b} {item} in each. How many {item} are there in total?",
            f"Each of the {a} {box} holds {b} {item}, so there are {a} * {b} = {a * b} {item}. The answer is {a * b}.",
        )
    if kind == 3:
        b, c = _n(rng, 2, 10), _n(rng, 2, 12)
        a = b * c
        return (
            f"{name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?",
            f"{a} {item} shared among {b} friends gives {a} / {b} = {c} {item} each. The answer is {c}.",
        )
    if kind == 4:
        thing, things = rng.choice(_THINGS)
        p, n = _n(rng, 2, 15), _n(rng, 2, 9)
        return (
            f"One {thing} costs {p} dollars. How much do {n} {things} cost?",
            f"{n} {things} cost {n} * {p} = {n * p} dollars. The answer is {n * p}.",
        )
    if kind == 5:
        thing, things = rng.choice(_THINGS)
        p, n = _n(rng, 2, 9), _n(rng, 2, 6)
        cost = p * n
        bill = next(b for b in (10, 20, 50, 100) if b > cost)
        return (
            f"{name} buys {n} {things} at {p} dollars each and pays with a {bill}-dollar bill. How "
            f"much change does {he} get?",
            f"The {things} cost {n} * {p} = {cost} dollars. The change is {bill} - {cost} = "
            f"{bill - cost} dollars. The answer is {bill - cost}.",
        )
    if kind == 6:
        s, h = rng.choice([30, 40, 45, 50, 60, 70, 80, 90, 100, 120]), _n(rng, 2, 6)
        vehicle = rng.choice(["train", "car", "bus", "truck"])
        return (
            f"A {vehicle} travels at {s} km per hour for {h} hours. How far does it travel?",
            f"Distance is speed times time: {s} * {h} = {s * h} km. The answer is {s * h}.",
        )
    if kind == 7:
        a, b, c = _n(rng, 5, 40), _n(rng, 1, 15), _n(rng, 1, 10)
        return (
            f"{name} is {a} years old. {friend} is {b} years older than {name}. How old will {friend} be in {c} years?",
            f"{friend} is {a} + {b} = {a + b} years old now. In {c} years {friend} will be {a + b} "
            f"+ {c} = {a + b + c}. The answer is {a + b + c}.",
        )
    if kind == 8:
        w, h = _n(rng, 2, 20), _n(rng, 2, 20)
        if rng.random() < 0.5:
            return (
                f"A rectangle is {w} cm wide and {h} cm long. What is its area?",
                f"The area is width times length: {w} * {h} = {w * h} square cm. The answer is {w * h}.",
            )
        return (
            f"A rectangle is {w} cm wide and {h} cm long. What is its perimeter?",
            f"The perimeter is 2 * ({w} + {h}) = 2 * {w + h} = {2 * (w + h)} cm. The answer is {2 * (w + h)}.",
        )
    a, b, c = _n(rng, 2, 30), _n(rng, 2, 5), _n(rng, 2, 10)
    total = a + b * c
    d = _n(rng, 1, total - 1)
    box = rng.choice(["packs", "bags", "boxes"])
    return (
        f"{name} has {a} {item}. {He} buys {b} {box} with {c} {item} in each, then gives {d} "
        f"{item} to {friend}. How many {item} does {name} have now?",
        f"The {box} hold {b} * {c} = {b * c} {item}. Then {name} has {a} + {b * c} = {total} {item}. "
        f"After giving away {d}, {he} has {total} - {d} = {total - d}. The answer is {total - d}.",
    )


def format_math(q: str, a: str) -> str:
    return f"Question: {q}\nAnswer: {a}"


def build_math(
    rng: random.Random,
    n_train: int = 40_000,
    n_heldout: int = 1_500,
    n_prompts: int = 48,
    n_test: int = 48,
) -> tuple[list[str], list[str], list[dict], list[dict]]:
    """(train documents, held-out documents, dev prompts, test prompts): the prompts are the
    first held-out problems, dev before test."""
    train: list[str] = []
    heldout: list[str] = []
    prompts: list[dict] = []
    test: list[dict] = []
    seen: set[str] = set()
    for _ in range(n_train):
        q, a = math_problem(rng)
        seen.add(q)
        train.append(format_math(q, a))
    held_rng = random.Random(rng.random())
    while len(heldout) < n_heldout:
        q, a = math_problem(held_rng)
        if q in seen:
            continue
        seen.add(q)
        heldout.append(format_math(q, a))
        split = prompts if len(prompts) < n_prompts else test if len(test) < n_test else None
        if split is not None:
            tag = "math" if split is prompts else "math-test"
            split.append(
                {
                    "domain": "math",
                    "id": f"{tag}-{len(split):03d}",
                    "prompt": f"Question: {q}\nAnswer:",
                    "reference": f" {a}",
                }
            )
    return train, heldout, prompts, test
