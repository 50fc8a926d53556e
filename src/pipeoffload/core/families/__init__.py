"""Schedule generators, one module per family; each exports ``FamilySpec`` constants that
``pipeoffload.core.registry`` collects. ``block`` holds the shared building-block mechanism."""
