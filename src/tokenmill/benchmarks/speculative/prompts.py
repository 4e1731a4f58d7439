"""The workloads of ``bench speculative``: chat prompts whose answers copy from the prompt (code editing;
a mix of text edits, summaries, QA, typo fixes and records to JSON), and open-ended ones that do not."""

CODE = """class InventoryReport:
    def __init__(self, items, warehouse_name):
        self.items = items
        self.warehouse_name = warehouse_name

    def compute_total(self, items):
        total = 0
        for item in items:
            total += item.price * item.quantity
        return total

    def low_stock(self, threshold):
        result = []
        for item in self.items:
            if item.quantity < threshold:
                result.append(item.name)
        return result

    def most_valuable(self):
        best = None
        for item in self.items:
            value = item.price * item.quantity
            if best is None or value > best[1]:
                best = (item.name, value)
        return best

    def describe(self):
        lines = [f"Warehouse: {self.warehouse_name}"]
        for item in self.items:
            lines.append(f"{item.name}: {item.quantity} at {item.price}")
        return "\\n".join(lines)
"""

CODE_EDITING = [
    f"Rename the method compute_total to total_value in this code. Output the whole code.\n\n{CODE}",
    f"Add type hints to every method of this class. Output the whole code.\n\n{CODE}",
    f"Rename the variable items to products in this code. Output the whole code.\n\n{CODE}",
    f"Add a one-line docstring to each method of this class. Output the whole code.\n\n{CODE}",
    f"Rename the class InventoryReport to StockReport. Output the whole code.\n\n{CODE}",
    f"Replace the loop in low_stock with a list comprehension. Output the whole code.\n\n{CODE}",
]

TEXT = (
    "The city council met on Tuesday to discuss the new library. The building will open in March and "
    "will hold more than forty thousand books. Mayor Ellen Park said the library would also offer free "
    "classes for adults in the evenings. The project cost twelve million dollars, most of it paid by a "
    "state grant. Local schools plan to bring students every week."
)
RECORDS = (
    "name: Alice Smith, age: 34, city: Boston, job: engineer\n"
    "name: Bob Jones, age: 41, city: Denver, job: teacher\n"
    "name: Carol White, age: 29, city: Austin, job: designer"
)

COPY_MIX = [
    f"Rewrite this text in the past tense, changing nothing else:\n\n{TEXT}",
    f"Summarize this text in two sentences, reusing its words:\n\n{TEXT}",
    f"Answer from the text: what will the library offer adults, and who paid for it?\n\n{TEXT}",
    "Fix the typos and output the corrected text: 'Teh city councl met on Tusday to discus the new "
    "libary. The biulding will open in Marhc and will hold more then forty thousnad books.'",
    f"Convert these records to a JSON list of objects with keys name, age, city, job:\n\n{RECORDS}",
    f"Repeat the text, replacing 'library' with 'museum':\n\n{TEXT}",
]

TOPICS = [
    "the ocean",
    "a lost key",
    "winter mornings",
    "a robot learning to paint",
    "the history of bread",
    "why the sky is blue",
    "a city at night",
    "learning to swim",
    "an old lighthouse",
    "volcanoes",
    "a letter to a friend",
    "the first day of school",
]
OPEN_ENDED_FORMS = ["Write a short story about {}.", "Explain {} to a child.", "Write a poem about {}."]


def open_ended(count: int) -> list[str]:
    """``count`` prompts that ask for new text (nothing to copy from the prompt)."""
    prompts = [form.format(topic) for topic in TOPICS for form in OPEN_ENDED_FORMS]
    return [prompts[index % len(prompts)] for index in range(count)]
