"""The numeric bounds of a generation request, in one place.

The engine's parameter rules (`engine/sampling.py`, `SamplingParams.validate`) are the truth; they are
stated with these numbers, and the app and storage take theirs from this module, so a value the page
accepts is one the engine accepts (tests/app/test_limits.py sends each bound through both). It lives
beside the packages, not in `laneplay.engine`, and imports nothing: the app and storage reach the engine
over HTTP only, and importing `laneplay.engine` would load torch and the model code.

What is not a number here is fixed by what the parameter is: top_p in (0, 1], min_p in [0, 1], top_k an
integer >= 0 (0: off), max_tokens an integer >= 1 with prompt + max_tokens <= the model's context.
"""

MAX_N = 16  # samples of one request (n, or the length of `samples`)
MAX_STOP_STRINGS = 8
MAX_STOP_LENGTH = 256  # characters of one stop string
MAX_SEED = 2**63 - 1  # seeds are in [0, 2^63): a signed 64-bit integer, in SQL too
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.0, 100.0
MAX_TOP_K = 2**63 - 1  # the engine takes any integer >= 0 (at or above the vocabulary it is off); storage's column ends here
MAX_TOKENS = 1 << 20  # no served context is longer: the engine's own bound is the context (prompt + max_tokens)
# Penalties and bias (engine/sampling.py states what each does). frequency_penalty and presence_penalty take
# OpenAI's range; repetition_penalty is > 0 and at most this (1: off; > 1 discourages what was seen); each
# logit_bias entry is a token id -> a bias in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], at most MAX_LOGIT_BIAS_TOKENS of them.
MIN_PENALTY, MAX_PENALTY = -2.0, 2.0
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_TOP_LOGPROBS = 20  # alternatives reported per token (top_logprobs; completions' integer logprobs)
