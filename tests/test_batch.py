import pytest
import torch

from shardflow.data.batch import SequenceBatch


def make() -> SequenceBatch:
    tokens = [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])]
    return SequenceBatch.from_lists([5, 6, 7], {"ids": tokens}, {"reward": torch.tensor([1.0, 2.0, 3.0])},
                                    {"answer": ["a", "b", "c"]})


def test_select_concat_and_sort_round_trip():
    b = make()
    parts = [b.select([2, 0]), b.select([1])]
    back = SequenceBatch.concat(parts).sorted_by_id()
    assert torch.equal(back.token_fields["ids"], b.token_fields["ids"])
    assert torch.equal(back.seq_fields["reward"], b.seq_fields["reward"]) and back.meta == b.meta


def test_padded_and_unpad_are_inverse():
    b = make()
    padded = b.padded("ids", pad_value=-1)
    assert padded.tolist() == [[1, 2, 3], [4, -1, -1], [5, 6, -1]]
    assert torch.equal(b.unpad(padded), b.token_fields["ids"])


def test_mismatched_fields_are_named():
    with pytest.raises(ValueError, match="token field 'ids' has 2 rows, expected 3 tokens"):
        SequenceBatch(torch.tensor([0, 1]), torch.tensor([1, 2]), {"ids": torch.zeros(2)})
