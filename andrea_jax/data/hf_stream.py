"""`hf:OWNER/NAME[/CONFIG]`: a Hugging Face dataset, streamed with `datasets.load_dataset(..., streaming=True)`.

The dataset's files are read in order and only as far as the run tokenizes, so a run
downloads about what it uses. Training takes `data.stream_tokens` tokens, 0 meaning what the
run's steps read (`pipeline.open_splits`); the training split's eras stop there, and the amount is part
of their key (not of validation's, so that a resume with more steps or an evaluation at another seq_len
finds validation's cache).
Validation is the first `data.stream_val_documents` documents of the dataset's
`data.val_split` when it has one, else the first documents of the training split, which
training then skips: no document is in both. The BPE sample is the first `data.tokenizer_train_bytes` of the training text.
Nothing is opened before a cache needs building, so a resume whose caches exist reads nothing.
A stream's reads record its state (`datasets`' `state_dict`), so an era's build opens the stream
where the era starts without streaming what came before it, and a timeout or a
5xx from the hub is retried from the last read (`sources.StreamedDocuments`). Errors no retry mends
(offline mode, a TLS certificate this machine does not trust, a proxy asking for credentials) stop
the run at once with one line that names the fix; the hub's own client is tried once before the
dataset is opened, since `datasets` reports them all as "Couldn't reach" it.

`hf:DIRECTORY` streams local JSON Lines or Parquet files through the same call, offline
(`load_dataset` takes the splits from the file names: `train.jsonl`, `validation.jsonl`, ...).
"""

from __future__ import annotations

import fractions
import functools
import os
import ssl
import urllib.parse
import ml_collections

from andrea_jax.data import DataError, local_files, sources

# data.order="random" draws windows at random over the cache: with a tenth more text than the
# steps read, a token is drawn about 0.9 times on average rather than once.
STREAM_MARGIN = fractions.Fraction(11, 10)
# Each turns the Hugging Face libraries offline (`datasets` reads the second, `huggingface_hub` the others).
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
INSTEAD = "or use data.source='tfds:...', 'text:PATH' or 'stdlib'"


def load_arguments(name: str, revision: str = "") -> dict:
    """`load_dataset` arguments for `hf:NAME`: a local directory, or a hub OWNER/NAME[/CONFIG] at `revision`."""
    path = os.path.abspath(os.path.expanduser(name))
    if os.path.isdir(path):
        if revision:
            raise DataError(f"data.hf_revision={revision!r} pins a hub dataset, and data.source='hf:{name}' is "
                            f"a local directory; leave data.hf_revision empty")
        return {"path": path}
    parts = name.split("/")
    if name.startswith(("/", ".", "~")) or len(parts) not in (2, 3) or not all(parts):
        raise DataError(f"data.source='hf:{name}' is neither a directory nor hf:OWNER/NAME[/CONFIG] "
                        f"(such as hf:HuggingFaceFW/fineweb-edu/sample-10BT)")
    return {"path": "/".join(parts[:2]), **({"name": parts[2]} if len(parts) == 3 else {}),
            **({"revision": revision} if revision else {})}


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the hub (HF_ENDPOINT, else huggingface.co) takes a connection within timeout_s."""
    endpoint = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    return sources.network_available(timeout_s, (endpoint.hostname or "", port))


def _load(arguments: dict, described: str, from_hub: bool):
    if from_hub:
        offline = [name for name in OFFLINE_VARIABLES if os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")]
        if offline:
            raise DataError(f"{' and '.join(offline)} {'is' if len(offline) == 1 else 'are'} set, and {described} "
                            f"streams from the hub; unset {'it' if len(offline) == 1 else 'them'}, {INSTEAD}")
        if not hub_reachable():
            raise DataError(f"the Hugging Face hub is unreachable, and {described} streams from it; run online, "
                            f"{INSTEAD}")
    try:
        import datasets
    except ImportError:
        raise DataError(f"{described} needs the datasets package; pip install -r requirements.txt") from None
    if from_hub:
        _check_hub_client(described)
    try:
        return datasets.load_dataset(**arguments, streaming=True)
    except Exception as error:  # many types (not found, gated, bad config, connection) for one cause
        if refused := refusal(error, described):
            raise refused from None
        if transient(error):  # the stream's reads retry it
            raise
        reason = " ".join(str(error).split()) or type(error).__name__
        raise DataError(f"cannot open {described} ({reason[:300]}); check data.source="
                        f"'hf:OWNER/NAME[/CONFIG]' against the dataset's page") from None


def dataset_revision(arguments: dict, local: bool) -> str | None:
    """The commit a hub dataset's stream reads now (its newest unless data.hf_revision pins one); None for
    local files, whose names, sizes and times key their caches instead."""
    if local:
        return None
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(arguments["path"], revision=arguments.get("revision")).sha
    except Exception as error:  # as load_dataset's: refused at once, or left to the caller's retries
        if refused := refusal(error, f"Hugging Face dataset {arguments['path']}"):
            raise refused from None
        raise


def _check_hub_client(described: str) -> None:
    """One request to the hub through `huggingface_hub`'s client (its certificates, proxy and offline switch),
    without its retries: what no retry mends is refused here; anything else is left to the stream's reads."""
    from huggingface_hub.utils import get_session

    try:
        response = get_session().head(os.environ.get("HF_ENDPOINT") or "https://huggingface.co", timeout=10)
    except Exception as error:
        if refused := refusal(error, described):
            raise refused from None
        return
    if response.status_code == 407:  # a plain-HTTP endpoint's proxy answers itself
        raise refusal(ConnectionError("407 Proxy Authentication Required"), described)


def open_hf(name: str, data: ml_collections.ConfigDict, steps_tokens: int) -> sources.Splits:
    # steps_tokens: the budget data.stream_tokens=0 stands for (`pipeline.open_splits`)
    """Train and validation documents of `hf:NAME`, opened at the first read (a hub dataset only
    once the hub answers)."""
    arguments = load_arguments(name, str(data.hf_revision))
    local = os.path.isdir(arguments["path"])
    field, train_split, val_split = str(data.text_field), str(data.train_split), str(data.val_split)
    val_documents, stream_tokens = int(data.stream_val_documents), int(data.stream_tokens)
    train_tokens = stream_tokens or steps_tokens
    described = "Hugging Face dataset " + "/".join(str(arguments[key]) for key in ("path", "name") if key in arguments)
    described += f" at revision {arguments['revision']}" if "revision" in arguments else ""
    dataset = functools.cache(lambda: _load(arguments, described, not local))

    def texts(val: bool, state: dict | None = None) -> _Texts:
        splits = dataset()
        if train_split not in splits:
            raise DataError(f"{described} has no split {train_split!r}; set data.train_split to one "
                            f"of {sorted(splits)}")
        held_out = val_split not in splits  # the train split's first documents are validation
        stream = splits[val_split if val and not held_out else train_split]
        stream = stream.skip(val_documents) if held_out and not val else stream
        if stream.features is not None and field in stream.features:
            stream = stream.select_columns([field])
        if state is not None:
            stream.load_state_dict(state)
        return _Texts(stream, field, described)

    identity = {"dataset": arguments, "field": field, "train_split": train_split,
                "val_rule": f"the first {val_documents} documents of split {val_split!r} if the dataset "
                            f"has it, else of {train_split!r}, which training skips"}
    if local:  # local files: their names, sizes and times are part of the key
        files = local_files.walk(arguments["path"], lambda name: not name.startswith("."))
        identity["files"] = local_files.fingerprint(arguments["path"], files)
    revision = functools.cache(lambda: dataset_revision(arguments, local))
    streamed = functools.partial(sources.StreamedDocuments, transient=transient, described=described,
                                 revision=revision)
    return sources.Splits(streamed(lambda state=None: texts(False, state)),
                          streamed(lambda state=None: texts(True, state), limit=val_documents),
                          identity, train_tokens=train_tokens)


class _Texts:
    """The text column of a stream's records, in order; `state()` is where the stream stands."""

    def __init__(self, stream, field: str, described: str) -> None:
        self.stream, self.field, self.described = stream, field, described
        self.records = iter(stream)

    def __iter__(self) -> "_Texts":
        return self

    def __next__(self) -> str:
        try:
            record = next(self.records)
        except Exception as error:
            if refused := refusal(error, self.described):
                raise refused from None
            raise
        if self.field not in record:
            raise DataError(f"{self.described} has no field {self.field!r}; set data.text_field to one of "
                            f"{sorted(record)}")
        text = record[self.field]
        if text is not None and not isinstance(text, str):  # str() of a list would train on its repr
            raise DataError(f"{self.described} field {self.field!r} holds {type(text).__name__} values, not "
                            f"text; set data.text_field to a column of strings")
        return text or ""

    def state(self) -> dict:
        return self.stream.state_dict()


# Errors of the HTTP clients under `datasets` (requests, httpx, aiohttp) that a later try may not
# meet, by class name so that none of them has to be installed.
_TRANSIENT_ERROR_NAMES = {"TransportError", "Timeout", "ChunkedEncodingError", "ClientConnectionError",
                          "ClientPayloadError", "ConnectionError"}


def _causes(error: BaseException) -> list[BaseException]:
    """The error and every error it was raised from or while handling, outermost first."""
    found, waiting = [], [error]
    while waiting and len(found) < 32:
        cause = waiting.pop(0)
        if cause is not None and all(cause is not seen for seen in found):
            found.append(cause)
            waiting += [cause.__cause__, cause.__context__]
    return found


def _status(error: BaseException) -> int | None:
    status = getattr(getattr(error, "response", None), "status_code", None)
    status = getattr(error, "status", None) if status is None else status  # aiohttp's
    return status if isinstance(status, int) else None


def _no_retry_fix(error: BaseException) -> tuple[str, str] | None:
    """(what is wrong, its fix) for an error no retry mends, else None. By class name and text, since
    `datasets` keeps only the class name of what it wraps (\"Couldn't reach ... (OfflineModeIsEnabled)\")."""
    for cause in _causes(error):
        text, names = str(cause), {kind.__name__ for kind in type(cause).__mro__}
        if "OfflineModeIsEnabled" in names or "OfflineModeIsEnabled" in text:
            return "offline mode is on", f"unset {', '.join(OFFLINE_VARIABLES[:-1])} and {OFFLINE_VARIABLES[-1]}"
        if isinstance(cause, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in text:
            return ("this machine does not trust the hub's TLS certificate",
                    "set SSL_CERT_FILE to a CA bundle that holds the certificate of the proxy or hub that signs it")
        if _status(cause) == 407 or ("407" in text and "proxy" in text.lower()):
            return ("the proxy asks for credentials (407 Proxy Authentication Required)",
                    "put them in HTTPS_PROXY as http://USER:PASSWORD@HOST:PORT")
    return None


def refusal(error: BaseException, described: str) -> DataError | None:
    """The one-line DataError for an error no retry mends, else None."""
    found = _no_retry_fix(error)
    if found is None:
        return None
    wrong, fix = found
    reason = " ".join(str(error).split())[:200] or type(error).__name__
    return DataError(f"{wrong}, so {described} cannot stream from the hub ({reason}); {fix}, {INSTEAD}")


def transient(error: BaseException) -> bool:
    """Whether a stream's error is worth a retry: a timeout, a dropped connection, a 429 or a 5xx, and
    neither a user error nor one `refusal` names."""
    if isinstance(error, DataError) or _no_retry_fix(error):
        return False
    for cause in (error, error.__cause__, error.__context__):
        if isinstance(cause, (TimeoutError, ConnectionError)) or \
                _TRANSIENT_ERROR_NAMES & {kind.__name__ for kind in type(cause).__mro__}:
            return True
        status = getattr(getattr(cause, "response", None), "status_code", None)
        if isinstance(status, int) and (status == 429 or status >= 500):
            return True
    return False
