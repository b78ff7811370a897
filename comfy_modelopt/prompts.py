"""Default calibration prompts: varied subjects, styles, compositions and lighting, so the
activation statistics cover what users actually generate (portraits, text, scenes, styles)."""

DEFAULT_PROMPTS = (
    "a portrait photo of an elderly woman with silver hair, soft window light, 85mm lens, shallow depth of field",
    "a red fox sitting in fresh snow at dawn, wildlife photography, highly detailed fur",
    "a bustling night market in Taipei, neon signs, steam rising from food stalls, cinematic",
    "an isometric illustration of a tiny cozy library inside a tree, warm colors",
    "a sports car drifting on a wet race track at night, motion blur, reflections",
    "a bowl of ramen with a soft-boiled egg, chopsticks, overhead food photography",
    "an astronaut floating inside a space station, earth visible through the window",
    "a watercolor painting of a lighthouse on a rocky coast during a storm",
    "a close-up macro photo of a dragonfly wing covered in dew drops",
    "a medieval castle on a cliff above a misty valley, fantasy concept art",
    "a minimalist poster with the words \"OPEN LATE\" in bold white letters on a blue background",
    "two children laughing while running through a sprinkler in a backyard, summer afternoon",
    "a cyberpunk city street in the rain, holographic advertisements, people with umbrellas",
    "an oil painting of a vase of sunflowers in the style of post-impressionism",
    "a snowy mountain landscape under the northern lights, long exposure",
    "a product photo of a white sneaker on a pastel pink background, studio lighting",
    "a golden retriever puppy wearing a tiny knitted hat, studio portrait",
    "an ancient temple overgrown with jungle vines, sunbeams through the canopy",
    "a chef plating a dessert in a busy restaurant kitchen, documentary photo",
    "a pixel art scene of a knight fighting a dragon, 16-bit video game style",
    "a glass of iced coffee on a marble table next to an open book, morning light",
    "a black and white street photo of a man reading a newspaper on a Paris bench",
    "a futuristic electric train crossing a desert bridge at sunset, wide angle",
    "a hand-drawn anime character with blue hair standing on a school rooftop, wind blowing",
    "an underwater coral reef with a sea turtle and schools of tropical fish",
    "a 3D render of a cute robot made of brass gears, octane render, soft shadows",
    "a foggy forest path in autumn with orange leaves on the ground",
    "an architectural photo of a modern concrete house with large glass windows by a lake",
    "a jazz band playing in a dim smoky club, warm spotlight, film grain",
    "a detailed pencil sketch of an old man's hands holding a pocket watch",
    "a field of lavender in Provence with a stone farmhouse, golden hour",
    "a still life of fruit, a wine bottle and bread on a wooden table, baroque painting",
)

DEFAULT_NEGATIVE = "blurry, low quality, distorted, watermark"
