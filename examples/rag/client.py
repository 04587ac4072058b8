"""Retrieval-augmented generation on the default repository, with the ``openai`` client only.

    python examples/rag/client.py [--url localhost:8000] [--reranker MODEL] [QUESTION]

1. Embed the built-in passages and the question with ``text_embedding`` (``/v1/embeddings``)
   and rank the passages by cosine similarity (numpy).
2. With ``--reranker``, rescore the best candidates with that cross-encoder (gpuserve's
   Cohere-style ``POST /v1/rerank``; the default repository serves none).
3. Ask ``chat`` the question with the top passages in the system message, streamed.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from openai import APIError, OpenAI

PASSAGES = [
    "The Rosetta Stone was found in 1799 by French soldiers near the town of Rashid (Rosetta) "
    "in the Nile Delta. It carries one decree in three scripts: hieroglyphic, Demotic and "
    "ancient Greek. Because scholars could read the Greek, it became the key to Egyptian "
    "hieroglyphs, which Jean-Francois Champollion deciphered in 1822.",
    "A honeybee colony in summer holds tens of thousands of workers, one queen and a few "
    "hundred drones. A forager tells her sisters where flowers are with the waggle dance: the "
    "angle of the run gives the direction relative to the sun, and its length the distance.",
    "Plants capture light with the chlorophyll in their chloroplasts and use its energy to turn "
    "carbon dioxide and water into sugar, giving off oxygen as a by-product. The light "
    "reactions run in the thylakoid membranes; the Calvin cycle fixes carbon in the stroma.",
    "A refrigerator moves heat instead of making cold. A compressor squeezes the refrigerant "
    "gas, which gives off heat through the coils at the back as it condenses; the liquid then "
    "passes an expansion valve and evaporates inside the cabinet, absorbing heat from the food.",
    "Tides are raised mainly by the Moon, whose gravity pulls harder on the side of the Earth "
    "facing it than on the far side, making two bulges of water. Most coasts see two high "
    "tides a day, and the larger spring tides come when the Sun and Moon line up.",
    "Sourdough bread rises without baker's yeast. Its starter is a culture of wild yeasts and "
    "lactic acid bacteria, kept alive with regular feedings of flour and water: the bacteria "
    "make the acids that give the bread its tang, the yeasts the gas that raises the dough.",
    "Iceland lies on the Mid-Atlantic Ridge, where the North American and Eurasian plates pull "
    "apart, above a hotspot. In April 2010 the eruption of Eyjafjallajokull threw ash into the "
    "jet stream, and most of European airspace was closed to flights for about six days.",
    "Around 1440 Johannes Gutenberg, a goldsmith in Mainz, built a printing press with movable "
    "metal type, an oil-based ink and a hand mould for casting letters. His Bible of about 1455 "
    "showed that books could be made in quantity, and printing spread quickly across Europe.",
    "The Hubble Space Telescope was launched in 1990 aboard the Space Shuttle Discovery. A flaw "
    "in its main mirror blurred its first images until astronauts fitted corrective optics in "
    "1993. Its observations helped to measure how fast the universe is expanding.",
    "Coffee plants are native to the highlands of Ethiopia. By the fifteenth century coffee was "
    "drunk in Sufi monasteries in Yemen, and coffee houses spread to Cairo and Istanbul, then "
    "in the seventeenth century to Venice, London and Vienna.",
    "The marathon recalls the legend of a Greek messenger who ran from the battlefield of "
    "Marathon to Athens. Its distance was fixed at 42.195 kilometres after the 1908 London "
    "Olympics, whose course ran from Windsor Castle to the royal box of the stadium.",
    "An octopus has three hearts and blue blood that carries oxygen with copper. About two "
    "thirds of its neurons are in its arms, which can taste and touch on their own, and it can "
    "change the colour and texture of its skin in a fraction of a second.",
]

QUESTION = "Why was European airspace closed in 2010?"
SYSTEM = (
    "Answer the question in one or two sentences, using only the passages below. "
    "If they do not hold the answer, say that you do not know.\n\n"
)


def embed(client: OpenAI, texts: list[str]) -> np.ndarray:
    """Unit-norm embeddings of ``texts``: float32 [len(texts), 384]."""
    answer = client.embeddings.create(model="text_embedding", input=texts)
    vectors = np.array([item.embedding for item in answer.data], dtype=np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def retrieve(client: OpenAI, question: str, k: int) -> list[tuple[int, float]]:
    """The ``k`` passages closest to ``question``: (index in PASSAGES, cosine), best first."""
    passages, (query,) = embed(client, PASSAGES), embed(client, [question])
    scores = passages @ query
    best = np.argsort(-scores)[:k]
    return [(int(i), float(scores[i])) for i in best]


def rerank(
    client: OpenAI, model: str, question: str, candidates: list[int], k: int
) -> list[tuple[int, float]]:
    """Rescore ``candidates`` (indices in PASSAGES) with a cross-encoder: the best ``k``."""
    body = {
        "model": model,
        "query": question,
        "documents": [PASSAGES[i] for i in candidates],
        "top_n": k,
    }
    answer = client.post("/rerank", cast_to=dict, body=body)  # not an OpenAI route
    return [(candidates[r["index"]], float(r["relevance_score"])) for r in answer["results"]]


def ask(client: OpenAI, question: str, passages: list[str], max_tokens: int) -> str:
    """Ask ``chat`` with ``passages`` as context; print the answer as it streams."""
    context = "\n\n".join(f"[{n}] {text}" for n, text in enumerate(passages, 1))
    stream = client.chat.completions.create(
        model="chat",
        messages=[
            {"role": "system", "content": SYSTEM + context},
            {"role": "user", "content": question},
        ],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},  # a last event with the token counts
    )
    pieces = []
    for event in stream:
        if event.choices and event.choices[0].delta.content:
            pieces.append(event.choices[0].delta.content)
            print(pieces[-1], end="", flush=True)
        if event.usage is not None:
            usage = event.usage
            print(f"\n== {usage.prompt_tokens} prompt tokens, {usage.completion_tokens} generated")
    return "".join(pieces)


def show(title: str, ranked: list[tuple[int, float]]) -> None:
    print(f"== {title}")
    for index, score in ranked:
        print(f"{score:7.3f}  [{index}] {PASSAGES[index][:70]}...")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default=QUESTION)
    parser.add_argument("--url", default="localhost:8000", help="server host:port (HTTP)")
    parser.add_argument("--top-k", type=int, default=2, help="passages given to the model")
    parser.add_argument("--reranker", help="a rerank model of the server (default: none)")
    parser.add_argument("--max-tokens", type=int, default=80)
    args = parser.parse_args(argv)

    client = OpenAI(base_url=f"http://{args.url}/v1", api_key="unused")
    # a reranker gets more candidates than it keeps, to bring a better one forward
    candidates = 3 * args.top_k if args.reranker else args.top_k
    try:
        ranked = retrieve(client, args.question, candidates)
        show("retrieved (cosine)", ranked)
        if args.reranker:
            ids = [index for index, _ in ranked]
            ranked = rerank(client, args.reranker, args.question, ids, args.top_k)
            show(f"reranked ({args.reranker})", ranked)
        print(f"== question: {args.question}")
        ask(client, args.question, [PASSAGES[i] for i, _ in ranked], args.max_tokens)
    except APIError as err:  # the server's message names the model or the field at fault
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
