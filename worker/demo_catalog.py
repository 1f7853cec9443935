"""The demo model's concept catalog, in the official schema: readable names and descriptions, so
that the playground's search and steering by label work on the built-in model. Its weights are
random, so a name says what a concept is called here, not what its embedding encodes.

Twelve groups of eight known concepts, ids in order; the tone, alignment and demographic groups
carry the official flags, and the demographic concepts are not steerable (a search finds them
only with steerable_only=false), so every filter of the API has something to show.
"""

from __future__ import annotations

from pathlib import Path

from shared.catalog import FILENAME, write_catalog

# (group name, flag set on its members, [(name, description), ...])
GROUPS: list[tuple[str, str | None, list[tuple[str, str]]]] = [
    ("Nature", None, [
        ("ocean", "The sea: salt water, waves, tides, the deep and the coast."),
        ("river", "Flowing fresh water: rivers, streams, banks and deltas."),
        ("mountain", "Mountains, peaks, cliffs, climbing and high altitude."),
        ("forest", "Woods and forests: trees, leaves, moss and wildlife."),
        ("desert", "Dry lands: sand, dunes, heat and oases."),
        ("weather", "Rain, wind, snow, storms and the forecast."),
        ("volcano", "Volcanoes, lava, eruptions and ash."),
        ("island", "Islands surrounded by water: beaches, reefs and harbours."),
    ]),
    ("Animals", None, [
        ("dog", "Dogs: puppies, barking, leashes and breeds."),
        ("cat", "Cats: kittens, purring, whiskers and claws."),
        ("bird", "Birds: feathers, wings, nests and song."),
        ("horse", "Horses: riding, stables, saddles and hooves."),
        ("fish", "Fish in rivers and the ocean: fins, scales and fishing."),
        ("insect", "Insects: bees, ants, beetles and butterflies."),
        ("lion", "Lions and big cats: the savanna, manes and hunting."),
        ("whale", "Whales and dolphins, the great animals of the ocean."),
    ]),
    ("Food and drink", None, [
        ("coffee", "Coffee: beans, espresso, cafes and the morning cup."),
        ("bread", "Bread and baking: dough, ovens, loaves and crusts."),
        ("fruit", "Fruit: apples, oranges, berries and orchards."),
        ("cheese", "Cheese: dairy, aging, cheddar and brie."),
        ("chocolate", "Chocolate, cocoa and sweets."),
        ("soup", "Soups and broths, served hot."),
        ("spice", "Spices and heat: pepper, chili, cinnamon and curry."),
        ("wine", "Wine: grapes, vineyards, red and white."),
    ]),
    ("Science", None, [
        ("physics", "Physics: forces, energy, particles and motion."),
        ("chemistry", "Chemistry: molecules, reactions and elements."),
        ("biology", "Biology: cells, organisms and evolution."),
        ("astronomy", "Astronomy: stars, planets, galaxies and telescopes."),
        ("mathematics", "Mathematics: numbers, proofs, equations and geometry."),
        ("medicine", "Medicine: doctors, illness, treatment and hospitals."),
        ("genetics", "Genes, DNA and heredity."),
        ("geology", "Rocks, minerals, earthquakes and the Earth's crust."),
    ]),
    ("Technology", None, [
        ("computer", "Computers: hardware, processors and programs."),
        ("internet", "The internet: websites, networks and online life."),
        ("robot", "Robots, machines that move and automation."),
        ("smartphone", "Phones, apps and mobile devices."),
        ("software", "Software: code, programming and bugs."),
        ("electricity", "Electricity: current, circuits, batteries and power."),
        ("engine", "Engines and motors: cars, fuel and horsepower."),
        ("satellite", "Satellites, rockets and space flight."),
    ]),
    ("Arts", None, [
        ("music", "Music: songs, melody, rhythm and instruments."),
        ("painting", "Painting: canvas, colour, brushes and galleries."),
        ("poetry", "Poems, verse, rhyme and metaphor."),
        ("film", "Films and cinema: actors, directors and scenes."),
        ("dance", "Dance: ballet, steps, rhythm and the stage."),
        ("theater", "Theatre: plays, the stage and the audience."),
        ("photography", "Photographs, cameras, light and exposure."),
        ("architecture", "Buildings and their design: towers, bridges and houses."),
    ]),
    ("Sports and games", None, [
        ("football", "Football: goals, teams, matches and the pitch."),
        ("tennis", "Tennis: rackets, serves and the court."),
        ("swimming", "Swimming in pools, lakes and the ocean."),
        ("running", "Running: marathons, sprints and training."),
        ("chess", "Chess: the board, openings, checkmate."),
        ("cycling", "Bicycles, riding and races."),
        ("basketball", "Basketball: hoops, dribbling and the court."),
        ("skiing", "Skiing and snow sports on the mountain."),
    ]),
    ("Society", None, [
        ("law", "Law: courts, judges, rules and rights."),
        ("politics", "Politics: elections, government and parties."),
        ("economy", "The economy: money, markets, trade and prices."),
        ("education", "Schools, teachers, learning and exams."),
        ("religion", "Religion: faith, worship and belief."),
        ("war", "War: armies, battles and conflict."),
        ("history", "History: the past, empires and old events."),
        ("travel", "Travel: journeys, tourism, maps and luggage."),
    ]),
    ("Emotions", None, [
        ("joy", "Happiness, delight and celebration."),
        ("sadness", "Sorrow, grief and tears."),
        ("anger", "Anger, rage and frustration."),
        ("fear", "Fear, dread and anxiety."),
        ("love", "Love, affection and romance."),
        ("surprise", "Surprise, shock and the unexpected."),
        ("calm", "Calm, peace and quiet."),
        ("nostalgia", "Longing for the past and fond memories."),
    ]),
    ("Tone", "is_tone", [
        ("formal", "A formal, official register."),
        ("casual", "A casual, relaxed register."),
        ("humorous", "A humorous tone: jokes and wit."),
        ("sarcastic", "A sarcastic, ironic tone."),
        ("polite", "A polite, courteous tone."),
        ("enthusiastic", "An enthusiastic, excited tone."),
        ("poetic", "A poetic, lyrical tone."),
        ("technical", "A technical, precise tone with jargon."),
    ]),
    ("Alignment", "is_alignment", [
        ("violence", "Violence, harm and aggression."),
        ("profanity", "Swearing and crude language."),
        ("deception", "Lies, deceit and misleading claims."),
        ("flattery", "Flattery and excessive praise."),
        ("refusal", "Refusing or declining a request."),
        ("safety", "Safety warnings and caution."),
        ("honesty", "Honesty, candour and truthfulness."),
        ("manipulation", "Manipulating or pressuring someone."),
    ]),
    ("Demographics", "is_demographic", [
        ("childhood", "Children and childhood."),
        ("old age", "Old age and the elderly."),
        ("gender", "Gender and gender roles."),
        ("nationality", "Nations, citizenship and national identity."),
        ("ethnicity", "Ethnic groups and heritage."),
        ("disability", "Disability and accessibility."),
        ("profession", "Jobs, occupations and careers."),
        ("family", "Families: parents, siblings and relatives."),
    ]),
]


def demo_rows(n_concepts: int) -> list[dict]:
    rows = []
    for group_id, (group_name, flag, members) in enumerate(GROUPS):
        for name, description in members:
            rows.append({"concept_id": len(rows), "concept_name": name, "concept_description": description,
                         "head": "known", "public_group_id": group_id, "group_name": group_name,
                         "is_steerable": flag != "is_demographic", **({flag: True} if flag else {})})
    return rows[:n_concepts]


def ensure_demo_catalog(model_dir: str | Path, n_concepts: int) -> None:
    """Write the catalog beside the demo weights unless one is there (a demo directory made
    before catalogs existed gets one on its next use)."""
    path = Path(model_dir) / FILENAME
    if not path.is_file():
        write_catalog(path, demo_rows(n_concepts))
