import pathlib
import sys

import pytest

# The harness modules live one folder up and are imported by name, as harness.py does.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


@pytest.fixture(scope="session")
def weights():
    import model

    return model.load()


@pytest.fixture(scope="session")
def tokenizer(weights):
    import model

    return model.build_tokenizer(weights.tokenizer_fields)
