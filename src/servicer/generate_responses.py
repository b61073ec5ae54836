"""One Generate call's responses: the scheduler's outputs for its n sequences become
stream chunks (every ``stream_interval`` tokens) and one GenerateComplete per sequence,
with their logprobs, as the smg router reads them."""

from __future__ import annotations

from collections.abc import Iterator

from scheduler.messages import LogprobLists, LogprobRows, RequestOutput

from .generated import sglang_scheduler_pb2 as pb


class _Sequence:
    """Progress of one of the n sequences: every output token (and its logprob row) so
    far, and how many of them went out in chunks."""

    __slots__ = ("index", "output_ids", "num_chunked", "sent_chunk", "logprobs", "input_logprobs", "input_sent")

    def __init__(self, index: int, want_logprobs: bool):
        self.index = index
        self.output_ids: list[int] = []
        self.num_chunked = 0  # output tokens already sent in chunks
        self.sent_chunk = False
        self.logprobs = LogprobLists() if want_logprobs else None  # aligned with output_ids
        self.input_logprobs: LogprobRows | None = None
        self.input_sent = False

    def add(self, out: RequestOutput) -> None:
        self.output_ids.extend(out.new_token_ids)
        if self.logprobs is not None and out.output_logprobs is not None:
            # rows come with every token, and a prompt-only request's one token_ids_logprob row
            # (prefill-only scoring) with no token
            self.logprobs.extend(out.output_logprobs)
        if out.input_logprobs is not None:
            self.input_logprobs = out.input_logprobs


class GenerateResponses:
    """Builds the responses of one Generate ``request`` whose sequences the scheduler
    knows as ``sequence_ids`` (n of them, in choice order)."""

    def __init__(self, request, sequence_ids: list[str]):
        self.request = request
        self.sequences = {sid: _Sequence(i, request.return_logprob) for i, sid in enumerate(sequence_ids)}
        self.num_unfinished = len(sequence_ids)
        sp = request.sampling_params
        # a chunk every stream_interval tokens (the first chunk of a sequence goes out at once)
        self.interval = sp.stream_interval if sp.HasField("stream_interval") and sp.stream_interval > 0 else 1

    @property
    def done(self) -> bool:
        return self.num_unfinished == 0

    def on_output(self, out: RequestOutput) -> Iterator[pb.GenerateResponse]:
        """The responses one scheduler output of a sequence calls for (none, a chunk,
        a complete, or both)."""
        seq = self.sequences[out.request_id]
        seq.add(out)
        finished = out.finish_reason is not None
        pending = len(seq.output_ids) - seq.num_chunked
        if self.request.stream and (not seq.sent_chunk or pending >= self.interval or (pending and finished)):
            yield pb.GenerateResponse(request_id=self.request.request_id, chunk=self._chunk(out, seq))
        if finished:
            self.num_unfinished -= 1
            yield pb.GenerateResponse(request_id=self.request.request_id, complete=self._complete(out, seq))

    def _chunk(self, out: RequestOutput, seq: _Sequence) -> pb.GenerateStreamChunk:
        """The tokens not yet chunked (with their logprob rows; the prompt's in the first
        chunk that has them); counts are cumulative."""
        start = seq.num_chunked
        chunk = pb.GenerateStreamChunk(
            token_ids=seq.output_ids[start:],
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens,
            cached_tokens=out.num_cached_tokens,
            index=seq.index,
        )
        if seq.logprobs is not None:
            chunk.output_logprobs.CopyFrom(self._output_logprobs(seq, start))
        if seq.input_logprobs is not None and not seq.input_sent:
            seq.input_sent = True
            chunk.input_logprobs.CopyFrom(self._input_logprobs(seq.input_logprobs))
        seq.num_chunked = len(seq.output_ids)
        seq.sent_chunk = True
        return chunk

    def _complete(self, out: RequestOutput, seq: _Sequence) -> pb.GenerateComplete:
        """Every output token and (cumulative) logprob of the sequence."""
        complete = pb.GenerateComplete(
            output_ids=seq.output_ids,
            finish_reason=out.finish_reason,
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens,
            cached_tokens=out.num_cached_tokens,
            index=seq.index,
            spec_draft_tokens=out.num_draft_tokens,
            spec_accepted_tokens=out.num_accepted_drafts,
        )
        if out.matched_token_id is not None:
            complete.matched_token_id = out.matched_token_id
        elif out.matched_stop_str is not None:
            complete.matched_stop_str = out.matched_stop_str
        if seq.logprobs is not None:
            complete.output_logprobs.CopyFrom(self._output_logprobs(seq, 0))
        if seq.input_logprobs is not None:
            complete.input_logprobs.CopyFrom(self._input_logprobs(seq.input_logprobs))
        return complete

    def _output_logprobs(self, seq: _Sequence, start: int) -> pb.OutputLogProbs:
        """OutputLogProbs of the sequence's output tokens [start:] (a chunk's, or all)."""
        lp = seq.logprobs
        msg = pb.OutputLogProbs(token_logprobs=lp.values[start:], token_ids=seq.output_ids[start:])
        if self.request.top_logprobs_num > 0:
            msg.top_logprobs.extend(
                pb.TopLogProbs(values=v, token_ids=i) for v, i in zip(lp.top_values[start:], lp.top_ids[start:])
            )
        if self.request.token_ids_logprob:
            wanted = list(self.request.token_ids_logprob)
            msg.token_ids_logprobs.extend(pb.TopLogProbs(values=v, token_ids=wanted) for v in lp.ids_values[start:])
        return msg

    def _input_logprobs(self, rows: LogprobRows) -> pb.InputLogProbs:
        msg = pb.InputLogProbs(
            token_logprobs=[
                pb.InputTokenLogProb() if v is None else pb.InputTokenLogProb(value=v) for v in rows.values
            ],
            token_ids=rows.token_ids,
        )
        if self.request.top_logprobs_num > 0:
            top_v = rows.top_values or [[]] * len(rows.values)
            top_i = rows.top_ids or [[]] * len(rows.values)
            msg.top_logprobs.extend(pb.TopLogProbs(values=v, token_ids=i) for v, i in zip(top_v, top_i))
        return msg
