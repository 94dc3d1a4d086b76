"""Fixed probes for the accuracy gate: short multi-passage questions written for ragfuse.

Each probe needs facts from more than one passage, so fused passages must attend across chunk
boundaries, which is exactly what full KV reuse gets wrong.
"""

from __future__ import annotations

PROBES: list[dict[str, object]] = [
    {
        "passages": [
            "The Marrow Canal was dug between 1822 and 1829 to carry coal from the Ebbing hills to the port "
            "of Saltreach. Its engineer, Agnes Voll, designed eleven locks that lift boats a total of 64 "
            "metres. The canal closed to commercial traffic in 1958 and reopened for leisure boats in 1994.",
            "Agnes Voll was born in the mill town of Harrowgate in 1790. Before the canal she built two stone "
            "bridges over the river Teal. She died in Saltreach in 1851 and is buried beside the canal's "
            "top lock, where a bronze statue of her was unveiled in 2001.",
            "Saltreach grew from a fishing village of 800 people in 1800 to a port city of 60,000 by 1900. "
            "Its harbour master's house is now the Canal Museum, which holds Voll's original lock drawings.",
        ],
        "question": "In which town was the engineer of the Marrow Canal born?",
    },
    {
        "passages": [
            "The Osprey Cup is a rowing race held every June on Lake Merrin. Crews row 3.2 kilometres from "
            "the boathouse at Pellow Point to the finishing buoys off Castle Isle. The race was first held "
            "in 1911 and has been won most often by the Merrin Rowing Club, with 37 victories.",
            "The Merrin Rowing Club trains from a boathouse built in 1904. Its most famous coach, Ruth Abara, "
            "led the club to nine straight Osprey Cup wins between 1962 and 1970 and later coached the "
            "national eight at two Olympic Games.",
            "Castle Isle is a wooded island of 12 hectares in the north of Lake Merrin. A ruined tower on it "
            "dates from the 1300s. Boats may land there only between May and September.",
        ],
        "question": "Which coach won the race that finishes off Castle Isle nine times in a row?",
    },
    {
        "passages": [
            "Brightwater Observatory stands at 2,350 metres on Mount Calder. Its main telescope, the Hale-Imre "
            "reflector, has a mirror 3.6 metres across and saw first light in 1977. The site was chosen for "
            "its dry air: it averages 290 clear nights a year.",
            "The Hale-Imre reflector was used in 1983 by the astronomer Kofi Mensah to find the comet that "
            "now bears his name. Comet Mensah returns every 71 years and will next pass the Sun in 2054.",
            "Mount Calder is reached by a 31-kilometre mountain road from the village of Dunley. In winter "
            "the road closes after heavy snow, and observers stay at the summit for up to two weeks.",
        ],
        "question": "In what year will the comet found with Brightwater's main telescope next pass the Sun?",
    },
]
