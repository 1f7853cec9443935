"""The words the reference model's English is made of: sixteen topics, three subtopics each.

Written by hand for this repo (nothing downloaded). A topic has people, places and adjectives; a
subtopic has nouns and actions (predicates that follow a person: "the sailor <action>"). The
generator builds sentences from these, the concept catalog describes its topics with them, and
the eval's topic judge counts the words that belong to one topic only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Subtopic:
    name: str
    nouns: tuple[str, ...]
    actions: tuple[str, ...]


@dataclass(frozen=True)
class Topic:
    name: str  # the concept name, e.g. "Ocean"
    phrase: str  # how a prompt names it: "the ocean"
    people: tuple[str, ...]
    places: tuple[str, ...]
    adjectives: tuple[str, ...]
    subtopics: tuple[Subtopic, ...]


def _s(name: str, nouns: str, actions: str) -> Subtopic:
    return Subtopic(name, tuple(nouns.split(", ")), tuple(actions.split("; ")))


def _t(name: str, phrase: str, people: str, places: str, adjectives: str, *subs: Subtopic) -> Topic:
    return Topic(
        name, phrase, tuple(people.split(", ")), tuple(places.split(", ")), tuple(adjectives.split(", ")), subs
    )


TOPICS: tuple[Topic, ...] = (
    _t(
        "Ocean",
        "the ocean",
        "sailor, diver, fisherman",
        "harbor, open sea, bay",
        "salty, blue, deep, vast, foamy, tidal",
        _s(
            "Marine life",
            "coral reef, dolphin, whale, octopus, jellyfish, sea turtle, shark, starfish",
            "watches a school of fish; photographs the coral reef; swims beside a sea turtle; counts the jellyfish; "
            "follows a pod of dolphins",
        ),
        _s(
            "Sailing",
            "sailboat, mast, anchor, deck, compass, lighthouse, sail, hull",
            "raises the sail at dawn; drops the anchor in the bay; steers by the lighthouse; scrubs the wooden deck; "
            "checks the compass",
        ),
        _s(
            "Seashore",
            "tide, seashell, beach, seagull, wave, pebble, sandcastle, driftwood",
            "walks along the beach; collects seashells at low tide; builds a sandcastle; feeds the seagulls; "
            "listens to the waves",
        ),
    ),
    _t(
        "Space",
        "space",
        "astronaut, astronomer, cosmonaut",
        "space station, observatory, launch site",
        "cosmic, distant, weightless, orbital, starry, silent",
        _s(
            "Planets",
            "Mars, Jupiter, Saturn, moon, orbit, crater, comet, asteroid",
            "maps the craters of the moon; studies the rings of Saturn; tracks a comet; measures the orbit of Mars; "
            "names a new asteroid",
        ),
        _s(
            "Rockets",
            "rocket, capsule, booster, countdown, launch pad, spacesuit, thruster, payload",
            "climbs into the capsule; checks the booster; starts the countdown; floats in a spacesuit; "
            "fires the thrusters",
        ),
        _s(
            "Stars",
            "star, galaxy, nebula, telescope, constellation, black hole, supernova, starlight",
            "points the telescope at a nebula; charts a constellation; photographs a distant galaxy; "
            "watches a supernova; studies a black hole",
        ),
    ),
    _t(
        "Cooking",
        "cooking",
        "chef, baker, cook",
        "kitchen, restaurant, bakery",
        "tasty, crispy, savory, golden, warm, delicious",
        _s(
            "Baking",
            "bread, oven, dough, flour, cake, pastry, butter, yeast",
            "kneads the dough; preheats the oven; sifts the flour; bakes a chocolate cake; "
            "brushes butter on the pastry",
        ),
        _s(
            "Soups",
            "soup, broth, pot, onion, garlic, ladle, carrot, stew",
            "stirs the pot of soup; chops an onion; simmers the broth; peels a carrot; tastes the stew with a ladle",
        ),
        _s(
            "Spices",
            "pepper, cinnamon, ginger, saffron, cumin, paprika, vanilla, chili",
            "grinds black pepper; sprinkles cinnamon on the rice; grates fresh ginger; toasts cumin seeds; "
            "adds a pinch of saffron",
        ),
    ),
    _t(
        "Music",
        "music",
        "pianist, singer, drummer",
        "concert hall, recording studio, music school",
        "loud, melodic, soft, rhythmic, lively, harmonic",
        _s(
            "Instruments",
            "guitar, piano, violin, drum, flute, trumpet, cello, harp",
            "tunes the guitar; plays the piano; practices the violin; taps the drum; polishes the trumpet",
        ),
        _s(
            "Concerts",
            "stage, audience, encore, orchestra, conductor, ticket, applause, spotlight",
            "walks onto the stage; bows to the audience; plays an encore; joins the orchestra; waits for the applause",
        ),
        _s(
            "Songs",
            "melody, chorus, lyric, rhythm, verse, song, harmony, tune",
            "hums a melody; writes a new song; sings the chorus; keeps the rhythm; learns the lyrics by heart",
        ),
    ),
    _t(
        "Sports",
        "sports",
        "coach, athlete, referee",
        "stadium, gym, arena",
        "fast, strong, competitive, athletic, fit, victorious",
        _s(
            "Football",
            "football, goal, goalkeeper, striker, penalty, team, corner kick, jersey",
            "kicks the football; scores a goal; saves a penalty; trains with the team; takes a corner kick",
        ),
        _s(
            "Running",
            "race, finish line, sprinter, marathon, track, stopwatch, medal, sneakers",
            "runs a marathon; crosses the finish line; laces up the sneakers; checks the stopwatch; wins a gold medal",
        ),
        _s(
            "Tennis",
            "racket, net, serve, court, tennis ball, umpire, volley, tiebreak",
            "swings the racket; hits a fast serve; rushes to the net; wins the tiebreak; returns a volley",
        ),
    ),
    _t(
        "Forest",
        "the forest",
        "ranger, woodcutter, forester",
        "woods, pine forest, valley",
        "green, shady, wild, mossy, leafy, ancient",
        _s(
            "Trees",
            "oak, pine, birch, bark, branch, leaf, root, moss",
            "plants a young oak; measures an old pine; touches the rough bark; climbs a birch; "
            "sweeps the fallen leaves",
        ),
        _s(
            "Wildlife",
            "deer, fox, owl, squirrel, bear, woodpecker, wolf, rabbit",
            "spots a deer; hears an owl at night; follows the tracks of a fox; watches a squirrel; "
            "listens to a woodpecker",
        ),
        _s(
            "Trails",
            "trail, campfire, tent, cabin, clearing, creek, footbridge, backpack",
            "hikes the trail; lights a campfire; pitches a tent; crosses the creek; rests in the clearing",
        ),
    ),
    _t(
        "City",
        "the city",
        "commuter, shopkeeper, taxi driver",
        "downtown, city center, main street",
        "busy, crowded, noisy, urban, modern, bright",
        _s(
            "Traffic",
            "taxi, bus, traffic light, crosswalk, subway, avenue, intersection, cyclist",
            "waits at the traffic light; catches the bus; takes the subway; hails a taxi; crosses the avenue",
        ),
        _s(
            "Buildings",
            "skyscraper, apartment, bridge, tower, elevator, rooftop, office, lobby",
            "rides the elevator; looks up at the skyscraper; crosses the bridge; works in an office; "
            "sits on the rooftop",
        ),
        _s(
            "Markets",
            "cafe, shop window, street vendor, newsstand, plaza, fountain, boutique, food stall",
            "buys a newspaper at the newsstand; orders coffee at a cafe; walks across the plaza; sits by the fountain; "
            "visits a food stall",
        ),
    ),
    _t(
        "Weather",
        "the weather",
        "forecaster, meteorologist, storm chaser",
        "weather station, coast, plains",
        "cloudy, windy, rainy, sunny, freezing, humid",
        _s(
            "Storms",
            "thunder, lightning, storm, rain, hail, wind, thundercloud, flood",
            "hears the thunder; watches the lightning; tracks the storm; measures the rain; records the hail",
        ),
        _s(
            "Snow",
            "snowflake, blizzard, frost, ice, snowman, icicle, sleet, snowdrift",
            "catches a snowflake; shovels the snowdrift; builds a snowman; scrapes the frost; warns of a blizzard",
        ),
        _s(
            "Sunshine",
            "sun, heat wave, rainbow, breeze, sky, forecast, humidity, drought",
            "enjoys the sun; spots a rainbow; reads the forecast; feels the breeze; predicts a heat wave",
        ),
    ),
    _t(
        "Computers",
        "computers",
        "programmer, engineer, hacker",
        "data center, server room, tech office",
        "digital, fast, binary, wireless, virtual, electronic",
        _s(
            "Programming",
            "code, bug, compiler, function, loop, variable, debugger, script",
            "writes the code; fixes a bug; runs the compiler; names a variable; steps through the debugger",
        ),
        _s(
            "Hardware",
            "keyboard, screen, processor, memory chip, laptop, motherboard, hard drive, cable",
            "types on the keyboard; replaces the hard drive; cleans the screen; installs a memory chip; "
            "plugs in the cable",
        ),
        _s(
            "Networks",
            "router, server, password, email, website, firewall, download, network",
            "resets the router; restarts the server; changes the password; answers an email; configures the firewall",
        ),
    ),
    _t(
        "Medicine",
        "medicine",
        "doctor, nurse, surgeon",
        "hospital, clinic, pharmacy",
        "healthy, sterile, medical, careful, healing, clinical",
        _s(
            "Hospitals",
            "ward, stretcher, ambulance, waiting room, surgery, x-ray, bandage, stethoscope",
            "checks the x-ray; wheels the stretcher; listens with a stethoscope; prepares for surgery; "
            "changes the bandage",
        ),
        _s(
            "Illness",
            "fever, cough, flu, virus, headache, vaccine, symptom, infection",
            "treats a fever; gives a vaccine; studies the virus; writes down the symptoms; fights an infection",
        ),
        _s(
            "Healthy habits",
            "vitamin, sleep, checkup, diet, hydration, stretching, blood pressure, heartbeat",
            "takes a vitamin; measures the blood pressure; counts the heartbeat; plans a healthy diet; books a checkup",
        ),
    ),
    _t(
        "Farming",
        "farming",
        "farmer, shepherd, farmhand",
        "farm, countryside, village",
        "rural, fertile, muddy, green, rustic, ripe",
        _s(
            "Crops",
            "wheat, corn, barley, tractor, harvest, field, plow, seed",
            "drives the tractor; plants the seeds; harvests the wheat; plows the field; waters the corn",
        ),
        _s(
            "Livestock",
            "cow, sheep, pig, goat, barn, hen, pasture, fence",
            "milks the cow; shears the sheep; feeds the pigs; collects eggs from the hens; mends the fence",
        ),
        _s(
            "Orchards",
            "apple tree, orchard, pear, cherry, ladder, basket, blossom, cider",
            "picks apples in the orchard; climbs the ladder; fills a basket with pears; prunes the cherry trees; "
            "presses the cider",
        ),
    ),
    _t(
        "Painting",
        "painting",
        "painter, artist, art student",
        "studio, gallery, art school",
        "colorful, vivid, abstract, bold, pale, bright",
        _s(
            "Colors",
            "palette, pigment, brushstroke, shade, hue, crimson, turquoise, ochre",
            "mixes colors on the palette; grinds a pigment; adds a crimson brushstroke; chooses a turquoise hue; "
            "blends the shades",
        ),
        _s(
            "Tools",
            "brush, easel, canvas, sketchbook, charcoal, watercolor, oil paint, frame",
            "sets up the easel; stretches a canvas; sketches with charcoal; cleans the brushes; fills the sketchbook",
        ),
        _s(
            "Galleries",
            "exhibition, portrait, landscape, sculpture, curator, masterpiece, gallery wall, museum",
            "hangs a portrait on the gallery wall; opens an exhibition; paints a landscape; meets the curator; "
            "admires a masterpiece",
        ),
    ),
    _t(
        "Trains",
        "trains",
        "engine driver, stationmaster, passenger",
        "railway station, depot, junction",
        "punctual, steady, long, noisy, old, fast",
        _s(
            "Stations",
            "platform, station, timetable, luggage, departure board, whistle, ticket office, waiting hall",
            "waits on the platform; reads the timetable; carries the luggage; checks the departure board; "
            "blows the whistle",
        ),
        _s(
            "Locomotives",
            "locomotive, steam engine, boiler, coal, smokestack, piston, wheel, brake",
            "shovels coal into the boiler; oils the pistons; starts the steam engine; checks the brakes; "
            "polishes the locomotive",
        ),
        _s(
            "Journeys",
            "carriage, sleeper car, dining car, tunnel, viaduct, railway, window seat, rails",
            "sits in the window seat; eats in the dining car; sleeps in the sleeper car; rides through a tunnel; "
            "crosses the viaduct",
        ),
    ),
    _t(
        "School",
        "school",
        "teacher, student, principal",
        "classroom, school library, schoolyard",
        "studious, strict, curious, busy, young, clever",
        _s(
            "Classrooms",
            "blackboard, chalk, desk, lesson, homework, textbook, pencil, notebook",
            "writes on the blackboard; finishes the homework; opens the textbook; sharpens a pencil; teaches a lesson",
        ),
        _s(
            "Exams",
            "exam, grade, quiz, test paper, answer sheet, revision, diploma, report card",
            "studies for the exam; hands in the test paper; checks the grades; fills in the answer sheet; "
            "receives a diploma",
        ),
        _s(
            "Playground",
            "recess, swing, slide, seesaw, lunchbox, school bus, bell, locker",
            "plays on the swings; rides the school bus; opens the lunchbox; waits for the bell; "
            "runs to the slide at recess",
        ),
    ),
    _t(
        "Chess",
        "chess",
        "grandmaster, chess player, champion",
        "chess club, tournament hall, park",
        "tactical, clever, quiet, strategic, sharp, patient",
        _s(
            "Openings",
            "pawn, knight, bishop, opening, gambit, castling, center, development",
            "moves a pawn to the center; develops the knight; offers a gambit; plays a sharp opening; castles early",
        ),
        _s(
            "Endgames",
            "king, rook, endgame, checkmate, stalemate, promotion, queen, draw",
            "promotes a pawn to a queen; delivers checkmate; avoids a stalemate; activates the rook; agrees to a draw",
        ),
        _s(
            "Tournaments",
            "chess clock, tournament, grandmaster title, rating, chessboard, round, opponent, scoresheet",
            "presses the chess clock; shakes hands with the opponent; writes the move on the scoresheet; "
            "wins the last round; raises the rating",
        ),
    ),
    _t(
        "Desert",
        "the desert",
        "nomad, explorer, camel driver",
        "desert, canyon, salt flat",
        "dry, hot, sandy, barren, dusty, scorching",
        _s(
            "Dunes",
            "dune, sandstorm, mirage, ridge, dust, sun-baked rock, horizon, footprint",
            "climbs the dune; shelters from the sandstorm; chases a mirage; follows the ridge; "
            "leaves footprints in the dust",
        ),
        _s(
            "Oases",
            "oasis, palm tree, well, spring, date palm, shade, water skin, tent camp",
            "reaches the oasis; draws water from the well; rests in the shade of a palm tree; fills the water skin; "
            "picks dates",
        ),
        _s(
            "Desert life",
            "camel, scorpion, lizard, cactus, vulture, rattlesnake, tumbleweed, coyote",
            "rides a camel; spots a scorpion; watches a lizard; photographs a cactus; hears a coyote",
        ),
    ),
)
