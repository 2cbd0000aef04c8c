"""megapack.data: raw data to `Document`s (token ids + per-token loss mask) ready for packing.

    read_documents(path)          one entry point, dispatching on the suffix:
      read_jsonl                  {"text"}, {"prompt", "completion"}, {"messages"} lines
      read_table                  the same records as Parquet / Arrow rows, HF save_to_disk dirs
      read_indexed                megatron-core .bin/.idx pairs
      read_numpy / documents_from_*  token arrays with offsets, eos splitting, lists of arrays
    split_document(doc, max_len)  cut long documents at message boundaries for a packer
    PackedDataset                 documents packed into equal per-rank shards of PackedBatch micro-batches,
                                  by a PackOptions and a LoadOptions (`megapack.packing.options`)
    PackWriter                    the same directory PackedDataset.save writes, streamed and resumable
                                  (the packed directory and its meta.json: packed_dir.py)
    step_batches                  each micro-batch's optimizer-step loss fields of a StreamingPacker
                                  global batch (for any iterator: megapack.with_loss_fields)
    ByteTokenizer, HFTokenizer    the Tokenizer protocol's two implementations
    ChatTemplate                  built-in chat rendering (the fallback, e.g. for ByteTokenizer)
    HFChatTemplate                a model's own Jinja chat template, as apply_chat_template renders it

Documents go into a batch as they are: ``PackedBatch.from_documents(docs, seq_len=4096)``.

Importing this package is cheap: megatron-core (indexed datasets) and ``tokenizers`` (HF) are
imported by the functions that need them, and torch with `PackedDataset` (its batches are torch
tensors), on first use of the name: reading and ``megapack pack`` never import torch.
"""

from typing import TYPE_CHECKING, Any

from megapack.data.arrays import (
    documents_from_array,
    documents_from_arrays,
    documents_from_eos,
    documents_from_offsets,
    read_numpy,
)
from megapack.data.chat import ChatTemplate
from megapack.data.document import Document
from megapack.data.hf_chat import ChatTemplateError, HFChatTemplate
from megapack.data.indexed import read_indexed
from megapack.data.jsonl import read_jsonl
from megapack.data.pack_writer import PackWriter
from megapack.data.read import read_documents
from megapack.data.records import BadLineError, Fields
from megapack.data.split import split_document
from megapack.data.tables import read_table
from megapack.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer

if TYPE_CHECKING:
    from megapack.data.dataset import PackedDataset
    from megapack.data.loss_steps import step_batches


def __getattr__(name: str) -> Any:
    """`PackedDataset` and the loss-step helpers on first use (they import torch; nothing else here does)."""
    if name == "PackedDataset":
        from megapack.data.dataset import PackedDataset

        return PackedDataset
    if name == "step_batches":
        from megapack.data.loss_steps import step_batches

        return step_batches
    raise AttributeError(f"module 'megapack.data' has no attribute {name!r}")


__all__ = [
    "BadLineError",
    "ByteTokenizer",
    "ChatTemplate",
    "ChatTemplateError",
    "Document",
    "Fields",
    "HFChatTemplate",
    "HFTokenizer",
    "PackWriter",
    "PackedDataset",
    "Tokenizer",
    "documents_from_array",
    "documents_from_arrays",
    "documents_from_eos",
    "documents_from_offsets",
    "read_documents",
    "read_indexed",
    "read_jsonl",
    "read_numpy",
    "read_table",
    "split_document",
    "step_batches",
]
