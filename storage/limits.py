"""Every size and range limit the storage layer enforces, in one place.

The app and `laneplay eval` validate first (and answer 4xx / a UI error); storage checks again so
that nothing oversized or malformed can reach the database by any path.
"""
from laneplay import limits as _engine

# Sessions
MAX_TITLE_CHARS = 200
MAX_MODEL_CHARS = 200                # a Hub id or a checkpoint directory name
MAX_DEVICE_CHARS = 32                # "cpu", "cuda", "cuda:7", ...
MAX_WORLD_SIZE = 8                   # DTP ranks: one node, up to 8 GPUs
MAX_COLUMNS = 4                      # side-by-side columns
MAX_CODE_CHARS = 64 * 1024           # editor contents
MAX_INSTRUCTION_CHARS = 16 * 1024
MAX_SESSIONS_PER_OWNER = 500         # one browser's History; past it a new session is refused
MAX_SESSIONS_LISTED = 500            # list_sessions / list_comparisons page size

# Sampling parameters (a session's `params`): the engine's bounds (laneplay/limits.py), so whatever the
# engine accepted can be stored
MAX_SAMPLES = _engine.MAX_N          # n per generation batch, N of pass@N
MAX_TOKENS = _engine.MAX_TOKENS      # max_tokens and any stored token count
MAX_TEMPERATURE = _engine.MAX_TEMPERATURE
MAX_TOP_K = _engine.MAX_TOP_K
MAX_SEED = _engine.MAX_SEED          # fits a signed 64-bit SQL integer
MAX_STOP_SEQUENCES = _engine.MAX_STOP_STRINGS
MAX_STOP_CHARS = _engine.MAX_STOP_LENGTH
MIN_PENALTY, MAX_PENALTY = _engine.MIN_PENALTY, _engine.MAX_PENALTY  # frequency and presence penalties
MAX_REPETITION_PENALTY = _engine.MAX_REPETITION_PENALTY

# Generations
MAX_OUTPUT_CHARS = 256 * 1024        # one sample's generated text
MAX_FINISH_REASON_CHARS = 32
MAX_GENERATIONS_PER_SESSION = 1_024  # 64 full batches of 16
MAX_METRIC = 1e9                     # ms, tokens/s: anything above is a unit bug, not a measurement

# pass@N comparisons
MAX_PROBLEM_SET_CHARS = 64
MAX_PROBLEM_ID_CHARS = 64
MAX_PROBLEMS = 512                   # HumanEval has 164
MAX_TESTS = 64                       # user-written tests of one comparison
MAX_TEST_CHARS = 8 * 1024
MAX_ERROR_CHARS = 2_000              # error excerpts are cut to this (keeping the end), not rejected
MAX_RUNTIME_S = 3_600.0
MAX_COMPARISONS_PER_SESSION = 64

# Share links
SHARE_TOKEN_BYTES = 32               # 256 bits from `secrets`; the issue asks for >= 128
OWNER_SECRET_BYTES = 32
MAX_TOKEN_CHARS = 128                # longer strings are not tokens: answered "not found" without a query
MAX_SHARES_PER_SESSION = 32
MAX_SNAPSHOT_BYTES = 16 * 1024 * 1024
MAX_SHARED_BYTES_PER_SESSION = 48 * 1024 * 1024  # all of a session's snapshots together (characters)
MAX_SHARED_BYTES_PER_OWNER = 256 * 1024 * 1024   # all snapshots of one owner's sessions together
MIN_OWNER_CHARS = 22                 # an owner id is a random token (>= 128 bits) the app issues
MAX_OWNER_CHARS = 128
