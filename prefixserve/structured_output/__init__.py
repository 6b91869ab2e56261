"""Structured outputs: answers constrained to a JSON Schema, regex, choice or Lark grammar.

vLLM v1's room of that name: a grammar backend behind one interface (`backend.py`, llguidance),
compiled on a worker thread and cached per tenant (`compiler.py`), one state per request
(`request_state.py`), the step's token bitmask filled while the forward pass runs
(`step_masks.py`), and the manager the engine and the scheduler talk to (`manager.py`).
"""
