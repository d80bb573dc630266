"""Hub repo ids: one rule for script 05 (the card's snippets download from the repo) and
script 06 (the commit goes there). Torch-free: the publish side uses it.

An id is ``namespace/name``, checked by the Hub client's own rule. The address of a model
repo's page gives its id: ``https://huggingface.co/namespace/name`` (``http``, ``hf.co``, a
trailing ``/``, a sub-page such as ``/tree/main`` or ``/blob/main/README.md``). Every other
page of the Hub (a dataset, a Space, a profile, the docs, the settings, a listing) is
refused, naming what it is: its path is never read as an id (``/datasets/squad`` is no model
repo ``datasets/squad``). A bare ``name`` is refused too: the card's snippets would download
the Hub's repo of that name, and the Hub resolves a bare name to a repo of its own, never
to the publisher's namespace."""

from __future__ import annotations

import re

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from .errors import RepoIdError

__all__ = ["hub_repo_id"]

# An address on the Hub's site, with or without its scheme (``huggingface.co/x`` is no repo id).
_HUB_PAGE = re.compile(
    r"^(?:https?://)?(?:www\.)?(?:huggingface\.co|hf\.co)(?::443)?(?P<path>/[^?#\s]*)?(?:[?#]\S*)?$",
    re.IGNORECASE,
)
# The sub-pages of a model repo's page: the address still names the repo.
_REPO_SUBPAGES = frozenset(
    {"tree", "blob", "resolve", "raw", "commit", "commits", "discussions", "settings", "edit"}
)
# Top-level pages of the Hub's site that are not a user's or an organization's, and what they are.
_SITE_PAGES = {
    "datasets": "a dataset's page",
    "spaces": "a Space's page",
    "docs": "a documentation page",
    "models": "the models listing",
    "organizations": "an organization's settings page",
    "settings": "an account settings page",
    "papers": "a paper's page",
    "collections": "a collection's page",
    "blog": "a blog post",
    "posts": "a post",
    "learn": "a course page",
    "tasks": "a task's page",
    "api": "an API address",
    "new": "the new-repo page",
    "new-dataset": "the new-dataset page",
    "new-space": "the new-Space page",
    "login": "the login page",
    "join": "the sign-up page",
    "pricing": "the pricing page",
    "enterprise": "the Enterprise page",
    "notifications": "the notifications page",
    "search": "the search page",
    "chat": "the chat page",
}
_INSTEAD = (
    "use the model repo's id 'namespace/name', or its page's address https://huggingface.co/namespace/name"
)


def hub_repo_id(text: str) -> str:
    """``text`` as a Hub model repo id, ``namespace/name``, or the id the address of a model
    repo's page gives (module docstring). Raises :class:`~pipeline.errors.RepoIdError`, one
    line that says what ``text`` is and what to write instead."""
    page = _HUB_PAGE.match(text.strip())
    repo_id = _id_of_page(text, page.group("path") or "") if page is not None else text
    if page is None and "://" in text:
        raise RepoIdError(
            f"--repo-id {text!r} is an address, but not of a page on huggingface.co: {_INSTEAD} "
            "(--endpoint names another Hub)"
        )
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise RepoIdError(
            f"--repo-id {text!r} is not a valid Hub repo id: use 'namespace/name' (letters, digits, '-', "
            "'_', '.'; no spaces, no '..', no trailing '/')"
        ) from None
    if "/" not in repo_id:
        raise RepoIdError(
            f"--repo-id {text!r} names no namespace: use 'namespace/name' (your user or organization, "
            "e.g. you/model): a bare name is a repo of the Hub's own, and the card's snippets download "
            "from exactly this id"
        )
    return repo_id


def _id_of_page(text: str, path: str) -> str:
    """The repo id of the Hub page at ``path``, or the refusal naming what the page is."""
    parts = [part for part in path.split("/") if part]
    if not parts:
        raise RepoIdError(f"--repo-id {text!r} is the Hub's front page, not a model repo's: {_INSTEAD}")
    what = _SITE_PAGES.get(parts[0].lower())
    if what is not None:
        raise RepoIdError(f"--repo-id {text!r} is {what}, not a model repo's: {_INSTEAD}")
    if len(parts) == 1:
        raise RepoIdError(
            f"--repo-id {text!r} is the profile page of the user or organization {parts[0]!r}, not a model "
            f"repo's: use '{parts[0]}/NAME', the id of one of its models"
        )
    if len(parts) > 2 and parts[2] not in _REPO_SUBPAGES:
        raise RepoIdError(
            f"--repo-id {text!r} is not the address of a model repo's page (nothing is at "
            f".../{parts[0]}/{parts[1]}/{parts[2]}): {_INSTEAD}"
        )
    return f"{parts[0]}/{parts[1]}"
