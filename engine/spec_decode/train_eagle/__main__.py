from engine.spec_decode.train_eagle.cli import main

if __name__ == "__main__":
    main()
