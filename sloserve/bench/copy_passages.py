"""Passages for ``sloserve bench --dataset-name copy`` (written for this project; no download).
Plain prose of 60-110 words each, on ordinary subjects."""

PASSAGES = (
    "The harbour wakes before the town does. At five the first boats slide out past the stone "
    "pier, their engines low, and the gulls follow them in a loose grey cloud. By seven the "
    "fish market has opened its shutters, and the smell of salt and diesel drifts up the "
    "narrow streets to the bakery, where the owner sets out the first trays of bread and "
    "props the door open with a brick.",
    "To repot a houseplant, water it the day before so that the roots slide out in one piece. "
    "Choose a pot only one size larger than the old one, with a hole in the bottom. Put a "
    "layer of fresh soil in the new pot, set the plant on it at the same depth as before, and "
    "fill the sides, pressing lightly. Water it well and keep it out of strong sun for a week.",
    "The library on Mill Road was built in 1904 with money from a local brewer, who asked only "
    "that his name be carved above the door. The reading room has tall windows on three sides "
    "and a ceiling painted with the signs of the zodiac. In the winter of 1963 the heating "
    "failed, and readers sat in their coats for six weeks while the council argued about the "
    "cost of new pipes.",
    "A good omelette takes less than two minutes. Beat three eggs with a pinch of salt until "
    "no streaks of white remain. Melt a knob of butter in a small pan over a medium heat, and "
    "when it stops foaming pour in the eggs. Stir them quickly with a fork while shaking the "
    "pan, then let them set for a few seconds, fold the omelette in three and slide it onto a "
    "warm plate.",
    "The meeting began late because the projector would not connect. When it finally did, the "
    "manager showed three slides: the sales for the quarter, the costs for the quarter, and a "
    "photograph of the new office. Nobody asked about the first two. Everyone asked about the "
    "third, and the rest of the hour was spent discussing where the kitchen would be and "
    "whether there would be enough parking.",
    "Rivers carry more than water. Each year a large river moves millions of tonnes of sand, "
    "silt and clay from the mountains to the sea. Where the current slows, at a bend or at the "
    "mouth, the heavier grains settle first and the finest clay last. Over centuries these "
    "layers build islands, shift channels and push the coastline outward, so that towns once "
    "built on the shore now stand miles inland.",
    "Dear neighbours, the water will be shut off on Thursday from nine in the morning until "
    "about two in the afternoon while the main pipe under the street is replaced. Please fill "
    "a few jugs the night before. The workers will need to park two vans in front of numbers "
    "twelve to eighteen, so we ask those households to use the side road for the day. Thank "
    "you for your patience.",
    "The old clock in the station tower runs four minutes fast, and has for as long as anyone "
    "can remember. Trains leave by the timetable, not by the clock, so travellers who trust it "
    "arrive early and wait on the cold platform. The station master once had it repaired, but "
    "within a month it was four minutes fast again, and he decided that the clock knew its own "
    "mind.",
    "To change a bicycle tyre, shift to the smallest gear and open the brake. Release the "
    "wheel and push one side of the tyre off the rim with two levers. Pull out the tube, find "
    "the hole, and check the inside of the tyre for the thorn or glass that made it. Fit a new "
    "tube with a little air in it, push the tyre back on with your thumbs, and pump it to the "
    "pressure printed on the side.",
    "In the spring the hillside turns yellow with gorse, and the bees come before the walkers "
    "do. By June the flowers have gone and the sheep graze between the spiny bushes, leaving "
    "tufts of wool on every branch. Birds collect the wool for their nests. In the autumn the "
    "farmer burns a strip along the top of the hill to stop the gorse from spreading into the "
    "fields below.",
)

#: what the prompt asks for, with the passage at ``{passage}``: repeat it or lightly edit it
INSTRUCTIONS = (
    "Repeat the following passage exactly, word for word.\n\nPassage:\n{passage}\n\n"
    "Repeated passage:\n",
    "Copy the following text, changing nothing.\n\nText:\n{passage}\n\nCopy:\n",
    "Rewrite the following passage in the past tense, keeping everything else the same.\n\n"
    "Passage:\n{passage}\n\nRewritten passage:\n",
    "Correct any spelling mistakes in the following text and return the whole text.\n\n"
    "Text:\n{passage}\n\nCorrected text:\n",
)
