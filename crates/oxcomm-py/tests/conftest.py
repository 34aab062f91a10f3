"""Process-wide settings of the Python tests."""

import os

# torchft's Rust side (read when torchft is first imported) logs every quorum at INFO into
# stderr, and a failing test's report shows the captured stderr whole: tens of thousands of
# lines that push the failure itself out of a CI log's tail. Warnings only, unless set.
os.environ.setdefault("RUST_LOG", "warn")
