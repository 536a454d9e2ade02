"""Supervised fine-tuning data: the one prompt template that SFT, RL and evaluation share.

An example is rendered as   format_prompt(prompt) + response + <|endoftext|>
and only the response tokens (and the closing EOT) are trained on. RL (rl.py) samples after format_prompt(prompt)
so the policy sees exactly what SFT taught it.
"""
from __future__ import annotations

EOT = 50256  # GPT-2 <|endoftext|> (data.EOT)


def format_prompt(prompt: str) -> str:
    """The text a model sees before its response, e.g. 'User: 12+7=?\\nAssistant:'; responses start with a space."""
    return f"User: {prompt.strip()}\nAssistant:"
