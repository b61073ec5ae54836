"""The fixed CPU workloads of shared/benchmarks.md: W64 (random token ids) and C64 (chat).

Each workload is a list of (prompt token ids, out_len): greedy, EOS ignored, every request
produces exactly out_len tokens, all submitted at t0.
"""

from __future__ import annotations

import random

Work = list[tuple[list[int], int]]


def w64(n: int = 64) -> Work:
    rng = random.Random(0)
    work = []
    for _ in range(n):
        prompt_len = rng.randint(64, 512)
        out_len = rng.randint(64, 256)
        work.append(([rng.randint(100, 49000) for _ in range(prompt_len)], out_len))
    return work


# C64's shared system prompt (250-350 tokens with the bundled model's tokenizer).
C64_SYSTEM = (
    "You are Juniper, the help desk assistant of the Riverside Public Library. You answer questions "
    "from library members and visitors in a friendly, patient and concise way. The library is open "
    "Monday to Friday from nine in the morning to eight in the evening, on Saturdays from ten to six, "
    "and it is closed on Sundays and public holidays. Members may borrow up to twenty items at a time. "
    "Books can be kept for three weeks, films and music for one week, and each loan can be renewed "
    "twice online or at the front desk, unless another member has reserved the item. Late returns cost "
    "twenty cents per day for each item, up to a maximum of five dollars per item; children's books "
    "have no late fees. A library card is free for anyone who lives, works or studies in the county: "
    "bring a photo identity document and a proof of address issued within the last three months. "
    "The second floor has a quiet reading room, six group study rooms that can be booked for up to "
    "three hours a day, and a computer lab with printers and scanners. Printing costs ten cents per "
    "black and white page and fifty cents per colour page. The wireless network is free and needs no "
    "password. The children's section on the ground floor hosts story time every Wednesday at ten "
    "thirty and a homework club on weekday afternoons. When you do not know an answer, say so plainly "
    "and suggest that the person ask a librarian at the front desk or call the main number. Never "
    "invent a policy, a price or an opening time. Keep your answers short, use plain language, and "
    "ask one clarifying question when a request is ambiguous."
)

# C64's 64 user questions (10-40 tokens each), one per request, in order.
C64_QUESTIONS = (
    "What time does the library open on Saturday morning?",
    "How many books can I borrow at the same time with a regular card?",
    "I lost my library card yesterday. What should I do to get a new one?",
    "Can I renew a book that someone else has already reserved?",
    "How much will I pay if I return a film four days late?",
    "Do you have a quiet place where I can study for my exams next week?",
    "Is the library open on Easter Monday, or is it closed like on other holidays?",
    "Can my ten year old daughter get her own library card?",
    "How do I book one of the group study rooms for my project team?",
    "What documents do I need to bring to sign up for a card?",
    "Is there a fee for using the computers in the lab?",
    "How much does it cost to print twenty pages in colour?",
    "Can I scan old family photos at the library and send them to my email?",
    "What is the password for the wireless network on the second floor?",
    "When is story time for toddlers, and do I need to register in advance?",
    "I live in the next county but work downtown. Can I still get a free card?",
    "How long can I keep a music CD before it is due back?",
    "Can I return books when the library is closed, for example late at night?",
    "My son returned a picture book two weeks late. Do we owe anything?",
    "Do you lend e-books or audiobooks that I can read on my phone?",
    "How can I find out whether a specific novel is available right now?",
    "Can I reserve a book online and pick it up at the front desk later?",
    "Is there a limit on how many times I can renew a loan?",
    "Does the library offer any help for people who are learning English?",
    "Can I bring my own laptop and work in the reading room all day?",
    "Are there any events for teenagers during the summer holidays?",
    "What happens if I damage a book by accident, for example with coffee?",
    "Can I donate a box of old books that I no longer need?",
    "Where can I park my bicycle when I visit the library?",
    "Is the building accessible for someone who uses a wheelchair?",
    "How do I pay a late fee if I do not have any cash with me?",
    "Can I use a study room alone, or is it only for groups?",
    "Could you recommend a good mystery novel for a long train journey?",
    "Do you have newspapers from other countries that I can read here?",
    "My card expired last month. How do I renew my membership?",
    "Can someone else pick up a reserved book for me if I am ill?",
    "Are dogs allowed inside the library if they stay on a leash?",
    "How do I print a document from my phone on your printers?",
    "What is the maximum late fee I can be charged for a single item?",
    "Is there a homework club for primary school children on Fridays?",
    "Can I eat my lunch in the reading room?",
    "Do you have a photocopier, and how much does one copy cost?",
    "I am a student at the university in town. Do I qualify for a free card?",
    "Can I borrow a film and a book on the same day?",
    "How far in advance can I book a study room?",
    "Does the library have computers with accessibility software for blind users?",
    "What should I do if the printer in the computer lab runs out of paper?",
    "Can I return items borrowed here at another branch of the library?",
    "Are there any quiet hours in the children's section for autistic kids?",
    "I found a mistake on my account: it shows a book I already returned. Can you help?",
    "How can I suggest that the library buy a new book it does not have yet?",
    "Is there a place to charge my phone inside the building?",
    "Can I attend story time with my grandson even though I am not a member?",
    "Do you offer classes on how to use a computer for older adults?",
    "What is the phone number of the front desk?",
    "How long does it take to get a library card after I apply?",
    "Can I borrow twenty films at once if I return them all within a week?",
    "Is the computer lab open during the whole opening hours of the library?",
    "Why was my renewal refused when I tried to renew my book online this morning?",
    "Are group study rooms equipped with a screen or a projector for presentations?",
    "Can I take photographs inside the library for a school project?",
    "Do you keep old local newspapers, for example from the nineteen seventies?",
    "How do I cancel a reservation I no longer need?",
    "Could you tell me a short, funny fact about libraries to cheer me up?",
)


def c64_messages(question: str) -> list[dict]:
    return [{"role": "system", "content": C64_SYSTEM}, {"role": "user", "content": question}]


def c64(tokenizer, n: int = 64) -> Work:
    """C64 rendered with ``tokenizer``'s chat template (generation prompt added)."""
    system_len = len(tokenizer(C64_SYSTEM, add_special_tokens=False)["input_ids"])
    assert 250 <= system_len <= 350, f"C64 system prompt is {system_len} tokens"
    assert len(set(C64_QUESTIONS)) == len(C64_QUESTIONS) == 64
    rng = random.Random(1)
    work = []
    for question in C64_QUESTIONS[:n]:
        question_len = len(tokenizer(question, add_special_tokens=False)["input_ids"])
        assert 10 <= question_len <= 40, f"C64 question {question!r} is {question_len} tokens"
        ids = tokenizer.apply_chat_template(
            c64_messages(question), add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        work.append((list(ids), rng.randint(64, 256)))
    return work


def load(name: str, model: str, n: int = 64) -> Work:
    """Workload ``name`` ("w64" or "c64") for ``model`` (C64 needs its tokenizer)."""
    if name == "w64":
        return w64()[:n]
    from transformers import AutoTokenizer

    from scheduler.model_source import prepare_tokenizer_dir, resolve_model

    tokenizer = AutoTokenizer.from_pretrained(prepare_tokenizer_dir(resolve_model(model)))
    return c64(tokenizer)[:n]
