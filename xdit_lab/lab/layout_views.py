"""Token layouts per model family: the sequence each family's attention sees, and who holds it.

    draw_token_layouts({"Flux": summaries, ...})

    Flux     |text|  0  0  0  0  1  1  1  1 |        text, then image: one joint attention
    SD3      |  0  0  0  0  1  1  1  1 |text|        image, then text: one joint attention
    PixArt   |  0  0  0  0  1  1  1  1 |   |text|    image in self-attention; text apart, the K/V of cross-attention

Image tokens are coloured by the rank that holds them under sequence parallelism (its shard before
the Ulysses all-to-all, from the run's summaries); the text is whole on every rank: an adapter
names where it sits (families/<family>.py), and sp_attention is told so.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .views import new_figure, rank_color

WHERE = {
    "first": "text, then image: one joint attention",
    "last": "image, then text: one joint attention",
    "cross": "image: self-attention; text apart (cross)",
    None: "image alone: no text",
}


def draw_token_layouts(by_family: dict[str, list[dict]]) -> Figure:
    """`by_family`: {label: the rank summaries of one sequence-parallel run of that family}. One row
    per family, tokens in attention order; under cross-attention the text is drawn after a gap."""
    fig = new_figure(figsize=(9, 0.8 * len(by_family) + 1.4))
    ax = fig.add_subplot()
    world = max(len(summaries) for summaries in by_family.values())
    longest = max(s[0]["image_tokens"] + (s[0]["shapes"]["text_len"] or 0) for s in by_family.values())
    labels = []
    for row, (label, summaries) in enumerate(by_family.items()):
        first = summaries[0]
        image, text, where = first["image_tokens"], first["shapes"]["text_len"] or 0, first["shapes"]["text_at"]
        offset = text if where == "first" else 0
        for s in summaries:
            for start, stop in s["shard"]["tokens"]:
                ax.broken_barh([(offset + start, stop - start)], (row - 0.35, 0.7), color=rank_color(s["rank"], world))
        if text:
            x = {"first": 0, "last": image}.get(where, image + 0.04 * longest)  # cross: apart, after a gap
            ax.broken_barh([(x, text)], (row - 0.35, 0.7), facecolor="#d9d9d9", edgecolor="black", linewidth=0.5)
        ax.broken_barh([(offset, image)], (row - 0.35, 0.7), facecolor="none", edgecolor="black", linewidth=0.5)
        labels.append(f"{label}: {image} image + {text} text tokens\n{WHERE[where]}")
    ax.set_yticks(range(len(labels)), labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("tokens, in the order the attention sees them", fontsize=9)
    ax.tick_params(labelsize=9)
    ax.set_title("who holds which tokens (sequence parallel, before the all-to-all)", fontsize=10)
    ranks = sorted({s["rank"] for summaries in by_family.values() for s in summaries})
    handles = [Patch(color=rank_color(r, world), label=f"rank {r}") for r in ranks]
    handles.append(Patch(facecolor="#d9d9d9", edgecolor="black", label="text: whole on every rank"))
    ax.legend(handles=handles, fontsize=9, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig
