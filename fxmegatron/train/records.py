"""Documents from columnar files: each row's text column of a Parquet file (``pyarrow.parquet``,
read one batch of rows at a time) or of a folder written by ``datasets.Dataset.save_to_disk``
(``datasets.load_from_disk``, memory-mapped Arrow), in row order. ``documents.py`` tokenizes
and caches them exactly as it does JSON Lines records. Whole rows (``*_rows``) feed the
chat and prompt/completion formats (``chat.py``), as JSON Lines records do."""
from __future__ import annotations

import importlib
from typing import Iterator

from fxmegatron.errors import DataError

# Rows converted to Python strings at a time: bounded memory on a large row group.
_BATCH_ROWS = 4096


def _need(module: str, kind: str):
    """``module`` imported, or a DataError saying how to install it (an optional dependency)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise DataError(f"data.kind = {kind!r} needs the {module.split('.')[0]} package ({e}): "
                        f"pip install 'fxmegatron[data]'") from None


def _strings(batches, path: str, field: str, typ) -> Iterator[str]:
    """Every value of the column's batches, refusing a null or non-string one by its row (from 0)."""
    row = 0
    for batch in batches:
        for value in batch:
            if not isinstance(value, str):
                raise DataError(f"{path}: row {row} (counting from 0): {field!r} (data.text_field) is {value!r}, "
                                f"not a string (column type {typ})")
            yield value
            row += 1


def _parquet(path: str):
    """The Parquet file at ``path``, opened (a DataError if it is not one)."""
    pa = _need("pyarrow", "parquet")
    pq = _need("pyarrow.parquet", "parquet")
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from e


def _dataset(path: str):
    """The ``Dataset.save_to_disk`` folder at ``path``, loaded. A ``DatasetDict`` folder is
    refused: which split trains and which validates is the user's choice, made by naming the
    split's folder (``PATH/train``), which is itself a Dataset's."""
    datasets = _need("datasets", "hf_dataset")
    try:
        ds = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise DataError(f"{path}: not a folder written by datasets' save_to_disk ({e})") from e
    if isinstance(ds, datasets.DatasetDict):
        raise DataError(f"{path}: a DatasetDict of splits {sorted(ds)}: give the folder of one split, e.g. "
                        f"{path}/{sorted(ds)[0]}, in data.train (and another in data.valid)")
    return ds


def parquet_texts(path: str, field: str) -> Iterator[str]:
    """The ``field`` column of every row of a Parquet file, in row order."""
    f = _parquet(path)
    schema = f.schema_arrow
    if field not in schema.names:
        raise DataError(f"{path}: no column {field!r} (data.text_field); it has {schema.names}")
    # A column of another type is refused at its first row (the value is what the user sees).
    batches = (b.column(0).to_pylist() for b in f.iter_batches(batch_size=_BATCH_ROWS, columns=[field]))
    yield from _strings(batches, path, field, schema.field(field).type)


def dataset_texts(path: str, field: str) -> Iterator[str]:
    """The ``field`` of every row of a ``Dataset.save_to_disk`` folder, in row order."""
    ds = _dataset(path)
    if field not in ds.column_names:
        raise DataError(f"{path}: no column {field!r} (data.text_field); it has {ds.column_names}")
    typ = ds.features[field]
    ds = ds.select_columns([field])
    yield from _strings((b[field] for b in ds.iter(batch_size=_BATCH_ROWS)), path, field, typ)


def parquet_rows(path: str) -> Iterator[tuple]:
    """``(where, row)`` of every row of a Parquet file as a dict of its columns, in row order."""
    row = 0
    for batch in _parquet(path).iter_batches(batch_size=_BATCH_ROWS):
        for rec in batch.to_pylist():
            yield f"{path}: row {row}", rec
            row += 1


def dataset_rows(path: str) -> Iterator[tuple]:
    """``(where, row)`` of every row of a ``Dataset.save_to_disk`` folder, in row order."""
    for row, rec in enumerate(_dataset(path)):
        yield f"{path}: row {row}", rec
