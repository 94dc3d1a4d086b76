"""The Gradio page: documents on the left (pick or upload, ingest with progress), the session on
the right (answers stream in with their sources), and each turn's TTFT with fused KV beside full
prefill's, measured on the same question.

The session's turns live in the page's state (one list per browser tab): questions are answered one
by one from the store, each from its own retrieval.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from ragfuse.documents import SUFFIXES
from ragfuse.engine import RagfuseError
from ragfuse.pipeline import AskResult

from .backend import FUSED_MODES, DemoBackend, Turn

TURN_COLUMNS = ["#", "question", "answer", "mode", "fused TTFT ms", "full TTFT ms", "speed-up", "recomputed",
                "KV from"]
TURN_WIDTHS = ["4%", "22%", "34%", "6%", "7%", "7%", "7%", "7%", "6%"]  # all columns in view, text wraps
INTRO = """# ragfuse demo
Ask questions about your documents. Each retrieved chunk's KV cache was computed when it was ingested;
the answer reuses it (**fuse** recomputes only the tokens whose KV deviates most), and the same question is
then prefilled in **full** to compare the time to the first token."""
# Gradio finds the progress tracker by its default value; tqdm bars (ingest's) are mirrored in the page
TRACK_TQDM = gr.Progress(track_tqdm=True)


def files_table(backend: DemoBackend) -> pd.DataFrame:
    return pd.DataFrame(backend.stored_files(), columns=["file", "chunks"])


def turns_table(turns: list[Turn]) -> pd.DataFrame:
    rows = [[i + 1, t.question, t.fused.answer, t.fused.mode, round(t.fused.ttft_s * 1e3),
             round(t.full.ttft_s * 1e3), f"{t.speedup:.1f}x", f"{t.fused.recompute_ratio:.0%}",
             ", ".join(t.fused.tiers) or "-"]
            for i, t in enumerate(turns)]
    return pd.DataFrame(rows, columns=TURN_COLUMNS)


def ttft_frame(turns: list[Turn]) -> pd.DataFrame:
    """One bar per turn and prefill kind, side by side (a shared x would stack them)."""
    rows = [(f"{i + 1} {kind}", kind, ms)
            for i, t in enumerate(turns)
            for kind, ms in ((t.fused.mode, t.fused.ttft_s * 1e3), ("full", t.full.ttft_s * 1e3))]
    return pd.DataFrame(rows, columns=["turn", "prefill", "TTFT ms"])


def ttft_plot(turns: list[Turn]) -> gr.BarPlot:
    frame = ttft_frame(turns)
    return gr.BarPlot(frame, sort=list(frame["turn"]))  # in turn order, not alphabetical


def fused_headline(fused: AskResult) -> str:
    return f"**TTFT: {fused.mode} {fused.ttft_s * 1e3:.0f} ms** · measuring full prefill of the same prompt…"


def ttft_headline(turn: Turn) -> str:
    """The comparison, then where the fused answer's time went (retrieval is not part of either TTFT)."""
    f = turn.fused
    tiers = f" from {', '.join(f.tiers)}" if f.tiers else ""
    return (f"**TTFT: {f.mode} {f.ttft_s * 1e3:.0f} ms vs full prefill {turn.full.ttft_s * 1e3:.0f} ms "
            f"({turn.speedup:.1f}x)** · KV of {f.reused_tokens} of {f.prompt_tokens} prompt tokens reused; "
            f"{f.recomputed_tokens} stored chunk tokens ({f.recompute_ratio:.0%}) recomputed  \n"
            f"{f.mode}: retrieval {f.retrieve_s * 1e3:.0f} ms · KV load {f.load_s * 1e3:.0f} ms{tiers} "
            f"({f.load_hidden:.0%} hidden behind compute) · prefill compute {f.recompute_s * 1e3:.0f} ms · "
            f"answer of {len(f.token_ids)} tokens in {f.total_s:.1f} s"
            + "".join(f"  \n_{note}_" for note in f.notes))  # e.g. KV that was not stored, computed now


def sources_markdown(turn: Turn) -> str:
    lines = ["**Sources**"]
    for s in turn.fused.sources:
        text = " ".join(s["text"].split())
        lines.append(f"- `{s['score']:.3f}` **{Path(s['source']).name}**: {text[:240]}{'…' if len(text) > 240 else ''}")
    return "\n".join(lines)


def ingest_summary(report: Any) -> str:
    skipped = "".join(f"\n- skipped {Path(s.path).name}: {s.reason}" for s in report.skipped)
    notes = "".join(f"\n- {Path(n.path).name}: {n.note}" for n in report.notes)
    return (f"Ingested: {len(report.new_files)} new, {len(report.replaced_files)} changed, "
            f"{len(report.unchanged_files)} unchanged files; +{report.chunks_added} chunks, "
            f"KV of {report.kv_computed} chunks precomputed ({report.seconds:.1f} s){skipped}{notes}")


def build_app(backend: DemoBackend) -> gr.Blocks:
    def on_ingest(picked: list[str], uploaded: list[str] | None, progress: gr.Progress = TRACK_TQDM):
        try:
            report = backend.ingest(picked or [], uploaded or [])
        except RagfuseError as exc:  # the user's mistake, shown on the page: no traceback in the server's log
            raise gr.Error(str(exc), print_exception=False) from exc
        return ingest_summary(report), files_table(backend), [], None

    def on_ask(question: str, mode: str, top_k: float, history: list[dict], turns: list[Turn]):
        history = [*history, {"role": "user", "content": question}, {"role": "assistant", "content": "…"}]
        skip = (gr.skip(),) * 5
        yield history, *skip
        try:
            for item in backend.ask(question, mode, int(top_k)):
                if isinstance(item, Turn):
                    turns = [*turns, item]
                    history[-1] = {"role": "assistant", "content": item.fused.answer}
                    yield (history, ttft_headline(item), ttft_plot(turns), sources_markdown(item),
                           turns_table(turns), turns)
                elif isinstance(item, AskResult):  # the fused answer is complete; full prefill runs now
                    yield history, fused_headline(item), *skip[1:]
                else:
                    history[-1] = {"role": "assistant", "content": item or "…"}
                    yield history, *skip
        except RagfuseError as exc:
            yield history[:-2], *skip  # the question stays in its box (no .success below) to fix and resend
            raise gr.Error(str(exc), print_exception=False) from exc

    with gr.Blocks(title="ragfuse demo", analytics_enabled=False) as demo:
        gr.Markdown(INTRO)
        turns = gr.State([])
        with gr.Row():
            with gr.Column(scale=1):
                gr.Markdown("## Documents")
                picked = gr.CheckboxGroup(backend.sample_docs(), label="Demo documents", elem_id="picked")
                uploaded = gr.File(file_count="multiple", file_types=sorted(SUFFIXES),
                                   label=f"Upload ({' '.join(sorted(SUFFIXES))})", elem_id="upload")
                ingest = gr.Button("Ingest", elem_id="ingest")
                status = gr.Markdown(elem_id="ingest-status")
                stored = gr.Dataframe(files_table(backend), label="In the store", interactive=False,
                                      elem_id="stored")
            with gr.Column(scale=2):
                chat = gr.Chatbot(label="Session", elem_id="chat", height=320)
                question = gr.Textbox(label="Question", placeholder="Ask about the documents", elem_id="question")
                with gr.Row():
                    mode = gr.Radio(list(FUSED_MODES), value="fuse", label="KV reuse", elem_id="mode")
                    top_k = gr.Slider(1, 8, value=3, step=1, label="chunks (top-k)", elem_id="top-k")
                    ask = gr.Button("Ask", variant="primary", elem_id="ask")
                ttft = gr.Markdown(elem_id="ttft")
                plot = gr.BarPlot(ttft_frame([]), x="turn", y="TTFT ms", color="prefill",
                                  title="Time to first token, fused vs full prefill", elem_id="ttft-plot")
                sources = gr.Markdown(elem_id="sources")
        table = gr.Dataframe(turns_table([]), label="Session turns", interactive=False, elem_id="turns", wrap=True,
                             column_widths=TURN_WIDTHS)
        ingest.click(on_ingest, [picked, uploaded], [status, stored, picked, uploaded],
                     concurrency_limit=1, concurrency_id="engine")
        for trigger in (ask.click, question.submit):
            trigger(on_ask, [question, mode, top_k, chat, turns], [chat, ttft, plot, sources, table, turns],
                    concurrency_limit=1, concurrency_id="engine").success(lambda: "", None, question)
    return demo
