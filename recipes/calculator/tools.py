"""The calculator recipe's tool (recipes/calculator-agent.yaml: `tools: [recipes/calculator/tools.py:add]`).

The recipe's tokenizer spells a call to it in few tokens: `{"name": "add", "arguments": {"a": ` is one token
(recipes/calculator/build_model.py), so renaming the tool or its arguments means rebuilding the model.
"""


def add(a: int, b: int) -> int:
    """Adds two integers exactly.

    Args:
        a: the first number
        b: the second number
    """
    return a + b
